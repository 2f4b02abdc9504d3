"""Config: the engine's effective config; edit a value in place, see the engine's answer.

The table has ~40 rows and changes only when the config or a reply does, so a DataTable is the
right tool here (unlike the Requests table). The edit itself is Steering's plan
(`vconsole.console.steering.Steering.plan_change`: validation, the risk check), carried out
through the host (``steer``: the box, then the control round trip), so the command palette and
tests use the same path. Below the table: the selected key's last answer and Steering's change log.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import DataTable, Input, Label, Static

from vconsole.console import format as fmt
from vconsole.console.changes import (
    APPLIED,
    ERROR,
    INVALID,
    PENDING,
    REJECTED,
    RESTART,
    TIMEOUT,
    UNCHANGED,
    ChangeRecord,
    show_value,
)
from vconsole.console.engine_state import ConfigView
from vconsole.console.keymap import CONFIG
from vconsole.console.screens.base import row_table
from vconsole.console.screens.filtered import FilteredScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.security.key_owner import GONE, UNKNOWN, KeyStatus
from vconsole.telemetry.printable import printable

REPLY_STYLE = {APPLIED: "green", UNCHANGED: "green", REJECTED: "red", INVALID: "red",
               ERROR: "red", TIMEOUT: "red", RESTART: "yellow", PENDING: "dim"}
HISTORY_STYLE = {APPLIED: "$success", UNCHANGED: "$success", REJECTED: "$error",
                 INVALID: "$error", ERROR: "$error", TIMEOUT: "$error", RESTART: "$warning",
                 PENDING: "$text-muted"}


def describe_range(row: dict[str, Any]) -> str:
    parts = [str(row.get("type", "?"))]
    if row.get("choices"):
        parts.append("one of " + ", ".join(map(str, row["choices"])))
    lo, hi = row.get("min"), row.get("max")
    if lo is not None or hi is not None:
        parts.append(f"{show_value(lo) if lo is not None else '…'}..."
                     f"{show_value(hi) if hi is not None else '…'}")
    if row.get("nullable"):
        parts.append("may be unset")
    parts.append(f"default {show_value(row.get('default'))}")
    return " · ".join(parts)


def key_holder(status: KeyStatus | None, engine_id: Any = None) -> str:
    """``key eng-0 pid 123``: the engine the console's control key belongs to (markup), warning
    when that engine is gone or is not the one answering (``engine_id`` from get_config)."""
    if status is None:
        return ""
    owner = status.owner
    if owner is None:
        return "[$text-muted]key: engine unknown[/]"
    text = fmt.escape(f"key {owner.engine_id} pid {owner.pid}")
    if status.state == GONE:
        return f"[$error]{text} gone[/]"
    if status.state == UNKNOWN:
        return f"{text} [$text-muted]on {fmt.escape(owner.host)}[/]"
    if engine_id is not None and engine_id != owner.engine_id:
        return f"[$warning]{text} ≠ engine {fmt.escape(str(engine_id))}[/]"
    return f"[$text-muted]{text}[/]"


class ConfigScreen(FilteredScreen):
    MODE = "config"
    TABLE = "cfg-table"
    COLUMNS = [("key", "key"), ("value", "value"), ("applies", "mode"),
               ("engine reply", "reply"), ("description", "description")]
    BINDINGS = CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.editing: str | None = None
        self._signature: tuple[Any, ...] | None = None
        self._keys: list[str] = []

    def compose_body(self) -> ComposeResult:
        yield Static(id="cfg-summary")
        yield row_table("cfg-table")
        yield Input(placeholder="filter keys (enter keeps, esc clears)", id="cfg-filter",
                    classes="filter-input")
        with Horizontal(id="cfg-edit"):
            yield Label("", id="cfg-edit-label")
            yield Input(id="cfg-input")
            yield Label(Content.from_markup("[$text-muted]enter sends · esc cancels[/]"),
                        id="cfg-edit-hint")
        yield Static(id="cfg-error")
        yield Static(id="cfg-detail")
        yield Static(id="cfg-history")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action == "edit" and self.console.readonly)

    # --- data ------------------------------------------------------------------------------

    def selected_key(self) -> str | None:
        row = self.table.cursor_row
        return self._keys[row] if 0 <= row < len(self._keys) else None

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        cfg = state.config
        app = self.console
        # Not id(cfg): the engine re-announces the same config every few seconds.
        sig = (cfg.version if cfg else None, repr(sorted(cfg.values.items())) if cfg else "",
               len(cfg.schema) if cfg else 0, app.steering.generation, self.filter_text)
        if sig != self._signature:
            self._signature = sig
            self._rebuild(cfg)
        self._show_summary(cfg, frame)
        self._show_detail(cfg)
        self._show_change_log()

    def _rebuild(self, cfg: ConfigView | None) -> None:
        table = self.table
        keep = self.selected_key()
        table.clear()
        self._keys = []
        if cfg is None:
            return
        q = self.filter_text.lower()
        replies = self.console.steering.replies
        for row in cfg.schema:
            key = str(row.get("key"))
            desc = str(row.get("description", ""))
            if q and q not in key.lower() and q not in desc.lower():
                continue
            rec = replies.get(key)
            reply = Text(printable(rec.summary()), style=REPLY_STYLE.get(rec.status, "")) \
                if rec else ""
            mode = Text("hot", style="green") if row.get("hot") else Text("restart",
                                                                          style="yellow")
            table.add_row(printable(key), printable(show_value(cfg.values.get(key))), mode, reply,
                          Text(fmt.clip(desc, 60), style="dim"), key=key)
            self._keys.append(key)
        if keep in self._keys:
            table.move_cursor(row=self._keys.index(keep), animate=False)

    def _show_summary(self, cfg: ConfigView | None, frame: Frame) -> None:
        steering = self.console.steering
        if cfg is None:
            how = ("asking the engine's control socket…" if steering.control is not None
                   else "waiting for the engine's config announcement…")
            err = steering.control_error
            text = f"[$text-muted]no config yet: {how}[/]"
            if err:
                text += f"\n[$warning]{fmt.escape(err)}[/]"
        else:
            restart = sum(1 for r in cfg.schema if not r.get("hot"))
            text = (f"config [b]v{cfg.version}[/] · {len(cfg.schema)} keys, {restart} "
                    f"restart-only · via {cfg.origin}")
            if self.filter_text:
                text += f" · filter [b]{fmt.escape(self.filter_text)}[/]"
            if frame.readonly:
                text += f" · [$warning]read-only: {fmt.escape(frame.readonly_reason)}[/]"
        holder = key_holder(steering.key_status, cfg.values.get("engine_id") if cfg else None)
        if holder:
            text += f" · {holder}"
        self.query_one("#cfg-summary", Static).update(Content.from_markup(text))

    def _show_detail(self, cfg: ConfigView | None) -> None:
        key = self.selected_key()
        box = self.query_one("#cfg-detail", Static)
        row = cfg.row(key) if cfg and key else None
        if row is None or key is None:
            box.update("")
            return
        mode = ("[$success]hot[/]: applied between two steps" if row.get("hot") else
                "[$warning]restart-only[/]: the engine answers 'restart required'")
        # The last answer for this key, whole (the table's column cuts it at 80 columns).
        rec = self.console.steering.replies.get(key)
        last = (f"\n[{HISTORY_STYLE.get(rec.status, '')}]{fmt.escape(rec.summary())}[/]"
                if rec else "")
        box.update(Content.from_markup(
            f"[b]{fmt.escape(key)}[/]  {mode}\n{fmt.escape(str(row.get('description', '')))}\n"
            f"[$text-muted]{fmt.escape(describe_range(row))}[/]{last}"))

    def _show_change_log(self) -> None:
        hist = self.console.steering.change_log
        box = self.query_one("#cfg-history", Static)
        if not hist:
            box.update(Content.from_markup("[$text-muted]no changes sent yet[/]"))
            return
        lines = ["[b]changes[/]"]
        for n, rec in reversed(list(enumerate(hist, 1))[-6:]):
            lines.append(f"[$text-muted]#{n:<3}[/] {fmt.escape(rec.key)} "
                         f"{fmt.escape(show_value(rec.old))} → "
                         f"{fmt.escape(show_value(rec.new))}  "
                         f"[{HISTORY_STYLE.get(rec.status, '')}]"
                         f"{fmt.escape(rec.summary())}[/]")
        box.update(Content.from_markup("\n".join(lines)))

    @on(DataTable.RowHighlighted, "#cfg-table")
    def _highlighted(self) -> None:
        cfg = self.console.state.config
        self._show_detail(cfg)

    # --- editing ---------------------------------------------------------------------------

    def action_edit(self) -> None:
        key = self.selected_key()
        cfg = self.console.state.config
        if key is None or cfg is None or self.console.readonly:
            return
        self.editing = key
        self.query_one("#cfg-edit-label", Label).update(f"{key} = ")
        box = self.query_one("#cfg-input", Input)
        box.value = show_value(cfg.values.get(key)) if cfg.values.get(key) is not None else ""
        self.query_one("#cfg-edit").add_class("-shown")
        self.show_error(None)
        box.focus()

    @on(DataTable.RowSelected, "#cfg-table")
    def _selected(self) -> None:
        self.action_edit()

    @on(Input.Submitted, "#cfg-input")
    def _submit(self, event: Input.Submitted) -> None:
        if self.editing is None:
            return
        host = self.console
        reason = host.steer(host.steering.plan_change(self.editing, event.value,
                                                      host.current_engine()))
        if reason is not None:      # the console's own check: nothing went to the engine
            self.show_error(f"not sent: {reason}")
            return
        self.close_editor()

    def show_error(self, reason: str | None) -> None:
        box = self.query_one("#cfg-error", Static)
        box.set_class(reason is not None, "-shown")
        box.update(Content.from_markup(f"[$error]✗ {fmt.escape(reason)}[/]") if reason else "")

    def close_editor(self) -> None:
        self.editing = None
        self.query_one("#cfg-edit").remove_class("-shown")
        self.show_error(None)
        self.table.focus()

    def action_clear_filter(self) -> None:
        if self.editing is not None:    # esc closes the editor first
            self.close_editor()
            return
        super().action_clear_filter()

    def focus_key(self, key: str) -> bool:
        if key not in self._keys:
            self.filter_text = ""
            self._signature = None
            self.console.refresh_view(force=True)
        if key in self._keys:
            self.table.move_cursor(row=self._keys.index(key), animate=False)
            return True
        return False

    def record_shown(self, rec: ChangeRecord) -> None:
        """Called by the app when a reply arrives, to surface an engine rejection inline."""
        if rec.status in (REJECTED, ERROR, TIMEOUT) and self.editing is None:
            self.show_error(f"{rec.key}: {rec.summary()}")
