"""What-if (``w``): edit a few keys and see, side by side, what the engine's recent traffic did
(live), what the simulation makes of it as it is (now) and with the edits.

The numbers come from `vconsole.console.predictions.WhatIf` (``app.whatif``): the engine's
trace of its last minutes, fetched over the control channel and kept 10 s, replayed through
the engine's own scheduler in the console's process. "now" and "with the edits" are both
simulated, so the simulation's own bias partly cancels in their change; "live" is what the
trace observed, the yardstick for how far "now" is off: "now vs live" says it per figure, and a
figure "now" misses by more than the step-time model's stated error is marked on both
predictions, with a line under the table that names it (`Prediction.rough`); "±" is each
figure's interval, and a change that cannot keep up with the arrivals says "overloaded" first,
with its capacity, its waits reading "grows" (`Prediction.overloaded`). Where the config
leaves ``num_kv_blocks`` unset (the pool sized from memory), its live value is the pool's real
size, from the engine's KV snapshot.

The editor's keys (`KEYS`) start at the live config and follow it until the operator types in
one; each is checked with `vconsole.whatif.predict.check_key` before a run (a bad value is
refused with the reason, nothing runs). Only the keys that differ from the live config form
the variant. ``A`` applies the hot ones through the host (one ``set_config`` after the
confirmation, which carries the same prediction); restart-only ones are named with the restart
command; a read-only console predicts but offers no apply. Predictions run when the screen is
shown (unless the last one is under 10 s old), on ``r`` or enter in the editor, and on ``x``
(reset to live) — never on a telemetry tick.

The summary's second line says which calibration the step costs stand on, or that there is
none (`vconsole.console.calibrating`). ``c`` runs one: ``vconsole whatif --calibrate`` on the
trace in hand, for the live config and the edits, as a child process with an engine of its
own (never the live engine), in a thread worker; the line follows its progress, a second
``c`` says it is still running, and when it ends the result is announced and the prediction
runs again on it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import DataTable, Input, Label, Static
from textual.worker import get_current_worker

from vconsole.console import format as fmt
from vconsole.console.calibrating import Outcome
from vconsole.console.changes import show_value
from vconsole.console.keymap import WHATIF
from vconsole.console.predictions import (
    KV_BLOCKS,
    MARK,
    PENDING,
    TRACE_MAX_AGE_S,
    Prediction,
    change_pct,
    change_style,
    figure,
    pending,
)
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.whatif.overload import GROWS, wait_mark
from vconsole.whatif.predict import ROW_LABELS, ROWS, check_key, pct, tolerance

KEYS = ("max_num_seqs", "max_num_batched_tokens", "policy", "num_kv_blocks", "block_size")


class WhatIfScreen(ConsoleScreen):
    MODE = "whatif"
    TABLE = "wi-table"
    COLUMNS = [("figure", "figure"), ("live", "live"), ("now", "now"),
               ("now vs live", "error"), ("with edits", "after"), ("±", "interval"),
               ("change", "change")]
    BINDINGS = WHATIF

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Any] = {}          # the live config's values of KEYS
        self.edited: set[str] = set()           # keys the operator typed in
        self.variant: dict[str, Any] = {}       # what the last run asked for
        self.result: Prediction | None = None   # its answer (PENDING while it runs)
        self._ran_at = -1e18                    # when (monotonic) the last run was asked
        self._filling = False                   # setting inputs ourselves: not an edit
        self._calibrating_since: float | None = None   # a calibration runs (monotonic start)
        self._calib_line = ""                   # its last progress line

    def compose_body(self) -> ComposeResult:
        yield Static(id="wi-summary")
        with Vertical(id="wi-form"):
            for key in KEYS:
                with Horizontal(classes="wi-row"):
                    yield Label(key, classes="wi-key")
                    yield Input(id=f"wi-{key}", classes="wi-input", select_on_focus=False)
                    yield Label("", id=f"wi-live-{key}", classes="wi-live")
        yield Static(id="wi-error")
        table: DataTable[Any] = DataTable(id="wi-table", cursor_type="none",
                                          zebra_stripes=False)
        yield table
        yield Static(id="wi-note")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "apply":
            return not self.console.readonly
        if action == "leave":           # the footer shows esc only while in the editor
            return isinstance(self.focused, Input)
        return True

    def on_descendant_focus(self) -> None:
        self.refresh_bindings()

    def on_descendant_blur(self) -> None:
        self.refresh_bindings()

    def on_screen_resume(self) -> None:
        """Shown: predict, unless the answer in hand stands on a trace still fresh."""
        super().on_screen_resume()
        if self.result is None or time.monotonic() - self._ran_at >= TRACE_MAX_AGE_S:
            self.call_after_refresh(self.action_run)

    # --- data ------------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        cfg = state.config
        live = {k: cfg.values.get(k) for k in KEYS} if cfg is not None else {}
        if cfg is not None and live.get("num_kv_blocks") is None:
            live["num_kv_blocks"] = self._pool(frame)
        if live != self.live:
            self.live = live
            self._fill()
        self._show_summary(frame)

    def _pool(self, frame: Frame) -> int | None:
        """The pool's real size when the config leaves it unset (sized from memory): the
        engine's KV snapshot says it, else the trace the last prediction stood on."""
        kv = frame.engine.latest.get("kv") if frame.engine is not None else None
        blocks = kv.get("num_blocks") if isinstance(kv, dict) else None
        if blocks is None and self.result is not None:
            blocks = self.result.live.get("num_kv_blocks")
        return int(blocks) if isinstance(blocks, int | float) else None

    def _fill(self) -> None:
        """Keys the operator has not typed in follow the live config."""
        cfg = self.console.state.config
        self._filling = True
        try:
            for key in KEYS:
                value = self.live.get(key)
                shown = "" if value is None else show_value(value)
                sized = (key == "num_kv_blocks" and value is not None and cfg is not None
                         and cfg.values.get(key) is None)
                label = f"live {shown or '–'}" + (" (sized from memory)" if sized else "")
                self.query_one(f"#wi-live-{key}", Label).update(
                    Content.from_markup(f"[$text-muted]{fmt.escape(label)}[/]"))
                box = self.query_one(f"#wi-{key}", Input)
                if key not in self.edited and box.value != shown:
                    box.value = shown
        finally:
            self._filling = False

    def _show_summary(self, frame: Frame) -> None:
        whatif = self.console.whatif
        if not whatif.available:
            text = f"[$warning]{fmt.escape(whatif.unavailable)}[/]"
        else:
            info = self.result.trace if self.result is not None else None
            info = info or whatif.trace_info
            if info is None:
                text = "[$text-muted]the engine's last minutes of traffic: not fetched yet[/]"
            else:
                err = (f" · step-time fit {tolerance(info.model_error)} per step"
                       if info.model_error is not None else "")
                text = (f"trace [b]{fmt.escape(info.describe())}[/] · {info.steps:,} steps"
                        f"{err}")
            if self._calibrating_since is not None:     # in place of the calibration's line
                took = time.monotonic() - self._calibrating_since
                text += (f"\n[$accent]calibrating… {took:.0f} s[/] [$text-muted]"
                         f"{fmt.escape(self._calib_line)}[/]")
            elif info is not None:
                text += f"\n[$text-muted]{fmt.escape(info.calibration)}[/]"
        if frame.readonly:
            text += "\n[$text-muted]read-only: predicts, never applies[/]"
        self.query_one("#wi-summary", Static).update(Content.from_markup(text))

    # --- the editor ------------------------------------------------------------------------

    @on(Input.Changed, ".wi-input")
    def _changed(self, event: Input.Changed) -> None:
        if self._filling or event.input.id is None:
            return
        key = event.input.id.removeprefix("wi-")
        live = self.live.get(key)
        if event.value == ("" if live is None else show_value(live)):
            self.edited.discard(key)
        else:
            self.edited.add(key)

    @on(Input.Submitted, ".wi-input")
    def _submitted(self) -> None:
        self.action_run()

    def action_edit(self) -> None:
        self.query_one(f"#wi-{KEYS[0]}", Input).focus()

    def action_leave(self) -> None:
        self.table.focus()

    def action_reset(self) -> None:
        self.edited.clear()
        self.live = {}
        self.console.refresh_view(force=True)   # refills every input from the live config
        self.show_error(None)
        self.action_run()

    def edits(self) -> dict[str, Any] | None:
        """The keys that differ from the live config, in their types; None (and the reason
        shown) when a value is refused."""
        out: dict[str, Any] = {}
        for key in KEYS:
            text = self.query_one(f"#wi-{key}", Input).value.strip()
            if not text:
                continue
            try:
                value = check_key(key, text)
            except ValueError as e:
                self.show_error(f"{key}: {e}")
                return None
            if value != self.live.get(key):
                out[key] = value
        self.show_error(None)
        return out

    def show_error(self, reason: str | None) -> None:
        box = self.query_one("#wi-error", Static)
        box.set_class(reason is not None, "-shown")
        box.update(Content.from_markup(f"[$error]✗ {fmt.escape(reason)}[/]") if reason else "")

    # --- predicting --------------------------------------------------------------------------

    def action_run(self) -> None:
        variant = self.edits()
        if variant is None:
            return
        self.variant = variant
        self._ran_at = time.monotonic()
        self.result = pending(variant)
        self._show_result()
        self.console.predict_later(self, [variant], self._predicted)

    def _predicted(self, predictions: list[Prediction]) -> None:
        (p,) = predictions
        if p.change != self.variant:
            return                      # an older run's answer: a newer one is on its way
        self.result = p
        self._show_result()
        self.console.refresh_view(force=True)

    def _show_result(self) -> None:
        """The answer in the table; while a run is pending the last answer stays, under
        "predicting…"."""
        table = self.table
        p = self.result
        note = self.query_one("#wi-note", Static)
        if p is None:
            note.update("")
            return
        if not p.ready:
            if p.status != PENDING:
                table.clear()
            style = "$text-muted" if p.status == PENDING else "$warning"
            note.update(Content.from_markup(f"[{style}]{fmt.escape(p.headline())}[/]"))
            return
        table.clear()
        flagged, error = p.rough, p.error
        stated = p.after_stated if self.variant else p.stated
        for k in ROWS:
            if k == KV_BLOCKS:
                live, now, edited = (figure(k, f.get(k), f.get("num_kv_blocks"))
                                     for f in (p.live, p.before, p.after))
                table.add_row(ROW_LABELS[k], live, now, "", edited if self.variant else "=", "",
                              "", key=k)
                continue
            b, a = p.before.get(k), p.after.get(k)
            mark = wait_mark(k, p.after_info.get("overload"))
            grows = mark == GROWS
            change = change_pct(b, a) if self.variant and not grows else ""
            style = change_style(k, b, a).lstrip("$")
            after = GROWS if grows else figure(k, a)
            table.add_row(ROW_LABELS[k], figure(k, p.live.get(k)),
                          _marked(figure(k, b), k in flagged),
                          Text(pct(error.get(k)) if p.live else "–",
                               style="yellow" if k in flagged else ""),
                          _marked(after, k in flagged) if self.variant or grows else "=",
                          Text("" if grows else mark or (
                              "" if (half := stated.get(k)) is None else tolerance(half)),
                               style="dim"),
                          Text(change, style={"success": "green", "warning": "yellow"}.get(
                              style, "dim")), key=k)
        note.update(Content.from_markup(self._note(p)))

    def _note(self, p: Prediction) -> str:
        if not self.variant:
            lines = ["[$text-muted]no edits: e edits a key, enter predicts · now = the "
                     "trace's own config, simulated[/]"]
        else:
            parts = [", ".join(f"{k}={show_value(v)}" for k, v in self.variant.items())]
            before, after = p.before.get("num_kv_blocks"), p.after.get("num_kv_blocks")
            if before != after:
                parts.append(f"pool {before} → {after} blocks")
            if p.after.get("rejected"):
                parts.append(f"[$warning]{p.after['rejected']} requests never fit that pool "
                             f"(left out)[/]")
            lines = ["[b]with edits[/] " + " · ".join(parts)]
        if p.overloaded or p.near_capacity:
            lines.insert(0, f"[$warning]{fmt.escape(p.overload_line())}[/]")
        cover = p.coverage_line() if self.variant else ""
        if cover:
            lines[-1] += f" [$text-muted]· {fmt.escape(cover)}[/]"
        rough = p.rough_line()
        if rough:
            lines.append(f"[$warning]{MARK} {fmt.escape(rough)}[/]")
        return "\n".join(lines)

    # --- calibrating ---------------------------------------------------------------------

    def action_calibrate(self) -> None:
        whatif = self.console.whatif
        if not whatif.available:
            self.notify(whatif.unavailable, title="Calibrate", severity="warning")
            return
        if self._calibrating_since is not None:
            took = time.monotonic() - self._calibrating_since
            self.notify(f"a calibration is already running ({took:.0f} s so far)",
                        title="Calibrate", severity="warning")
            return
        variant = self.edits()
        if variant is None:
            return
        self._calibrating_since, self._calib_line = time.monotonic(), "starting"
        self.notify("vconsole whatif --calibrate: an engine of its own probes the step "
                    "costs of the shapes the edits need (the live engine is not touched; "
                    "it shares this machine's cores until done)", title="Calibrating")
        self.console.refresh_view(force=True)

        def progress(line: str) -> None:
            self.app.call_from_thread(self._progress, line)

        def work() -> None:
            worker = get_current_worker()
            try:
                done = whatif.calibrate(variant, progress, lambda: worker.is_cancelled)
            except Exception as e:          # said on the screen, never a dead worker
                done = Outcome(False, f"calibration failed: {type(e).__name__}: {e}")
            if not worker.is_cancelled:
                self.app.call_from_thread(self._calibrated, done)

        self.run_worker(work, thread=True, group="calibrate")

    def _progress(self, line: str) -> None:
        """The command's latest line, shortened to one screen line (the notice at the end
        names the file)."""
        line = line.removeprefix("calibrating: ").split(", kept in ")[0]
        self._calib_line = line if len(line) <= 58 else line[:57] + "…"
        self.console.refresh_view(force=True)

    def _calibrated(self, done: Outcome) -> None:
        self._calibrating_since, self._calib_line = None, ""
        self.notify(done.message, title="Calibrated" if done.ok else "Calibration",
                    severity="information" if done.ok else "error",
                    timeout=10 if done.ok else 20)
        if done.ok:
            self.action_run()           # the next fetch picks the new calibration
        self.console.refresh_view(force=True)

    # --- applying ------------------------------------------------------------------------------

    def action_apply(self) -> None:
        if self.console.readonly:
            return
        variant = self.edits()
        if variant is None:
            return
        if not variant:
            self.notify("no edits: the live config is what runs", title="What-if")
            return
        cfg = self.console.state.config
        hot = {k: show_value(v) for k, v in variant.items()
               if cfg is not None and (row := cfg.row(k)) is not None and row.get("hot")}
        restart = [k for k in variant if k not in hot]
        if restart:
            self.notify("restart-only, not sent: restart the engine with " + " ".join(
                f"--set {k}={show_value(variant[k])}" for k in restart), title="What-if",
                severity="warning")
        if hot:
            host = self.console
            reason = host.steer(host.steering.plan_edits(hot, host.current_engine()))
            if reason is not None:
                self.notify(reason, title="What-if", severity="warning")


def _marked(value: str, rough: bool) -> Text:
    """A predicted figure, with `MARK` when the model misses its baseline (the note says)."""
    return Text.assemble(value, (f" {MARK}", "yellow")) if rough else Text(value)
