"""Fleet (``F``; the first screen whenever the console watches more than one target): one row
per engine of any kind, under the fleet's own row.

The fleet's row sums the queues and tokens/s of the engines that are up and shows the
**merged** TTFT / ITL percentiles (bucket counts summed across engines over the same window,
`vconsole.console.sources.fleet.merge`); a percentile known only as a range is shown as one.
Each engine's row: name, kind, model, state and for how long, running, waiting, KV use (``~``:
estimated, llama.cpp), generation tok/s, TTFT p50/p99, ITL p99, prefix hit rate, preemptions
(SGLang: retractions) a minute, active alerts or why it cannot be read. Below: the fleet's
imbalance findings (`vconsole.console.sources.fleet.imbalance`).

Keys: ``/`` filter (`vconsole.console.sources.fleet.view`), ``s`` / ``r`` sort, ``g`` group by
model, ``enter`` drills into the engine (every screen then shows it; ``esc`` or ``F`` comes
back), ``e`` one change for every engine of ours (the box lists every engine it touches; sent
one at a time; each one's answer a notice). Engines of other kinds are watched only: the hint
line says so.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from textual import on
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import DataTable, Input, Static

from vconsole.console import format as fmt
from vconsole.console.keymap import FLEET
from vconsole.console.screens.filtered import FilteredScreen
from vconsole.console.sources.fleet.control import parse_pairs, set_one, split
from vconsole.console.sources.fleet.imbalance import findings
from vconsole.console.sources.fleet.rows import Fleet, FleetAggregate, FleetRow
from vconsole.console.sources.fleet.targets import Target
from vconsole.console.sources.fleet.view import (
    SORTS,
    cells,
    filter_rows,
    group_by_model,
    percentile_text,
    sort_rows,
)
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.confirmation import ConfirmScreen

# (label, key, width): every column from 120 columns up; the narrow set below that.
# Each width holds a space after the text (the table has no cell padding).
WIDE = (("NAME", "name", 17), ("KIND", "kind", 10), ("MODEL", "model", 15),
        ("STATE", "state", 11), ("RUN", "running", 5), ("WAIT", "waiting", 5), ("KV", "kv", 5),
        ("TOK/S", "tok", 7), ("TTFT50", "ttft50", 9), ("TTFT99", "ttft99", 9),
        ("ITL99", "itl99", 9), ("HIT", "hit", 5), ("PRE/m", "preempt", 6),
        ("ALERTS", "alerts", 12))
NARROW = tuple(c for c in WIDE if c[1] in ("name", "kind", "state", "running", "waiting",
                                           "kv", "tok", "ttft99", "itl99"))
NARROW_BELOW = 120
COLUMNS = tuple((label, key) for label, key, _ in WIDE)
STATE_STYLE = {"up": "$success", "starting": "$warning", "stale": "$warning", "down": "$error"}


class FleetHost(Protocol):
    fleet: Fleet | None
    selected_engine: str | None

    def drill_in(self, engine_key: str) -> None: ...


class FleetScreen(FilteredScreen):
    MODE = "fleet"
    BINDINGS = FLEET
    TABLE = "fleet-table"
    COLUMNS = COLUMNS

    def __init__(self) -> None:
        super().__init__()
        self.sort_key = "name"
        self.reverse = False
        self.grouped = False
        self.row_keys: list[str] = []
        self.rows: dict[str, FleetRow] = {}
        # (row key, column) -> what its cell shows now (text, and the row state it is styled
        # by): a refresh updates only the cells whose text changed
        self.shown: dict[tuple[str, str], tuple[str, str | None]] = {}
        self.columns: tuple[tuple[str, str, int], ...] = ()

    def on_mount(self) -> None:
        self.table.focus()

    def _set_columns(self, width: int) -> None:
        """The column set for ``width`` (the table is rebuilt when it changes)."""
        cols = NARROW if width < NARROW_BELOW else WIDE
        if cols == self.columns:
            return
        table: DataTable[Any] = self.table
        table.clear(columns=True)
        for label, key, w in cols:
            table.add_column(label, key=key, width=w)
        self.columns = cols
        self.row_keys = []

    @on(DataTable.RowSelected, "#fleet-table")
    def _row_selected(self) -> None:
        self.action_drill()

    def compose_body(self) -> ComposeResult:
        yield Static(id="fleet-summary")
        yield DataTable(id=self.TABLE, cursor_type="row", zebra_stripes=False, cell_padding=0)
        yield Input(placeholder="filter: kind:sglang  waiting>0  pool=a100  word",
                    id="fleet-filter", classes="filter-input")
        yield Input(placeholder="every engine of ours: KEY=VALUE ... (enter: review, esc: "
                                "cancel)", id="fleet-set")
        yield Static(id="fleet-findings")
        yield Static(id="fleet-hint")

    @property
    def host(self) -> FleetHost:
        return cast(FleetHost, self.app)

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        fleet = self.host.fleet
        width = max(20, self.app.size.width - 2)
        if fleet is None:
            self.query_one("#fleet-summary", Static).update(Content.from_markup(
                "[$text-muted]one engine: the Fleet screen is for --target / --fleet / "
                "--discover with more than one[/]"))
            return
        rows = fleet.rows(state, frame.now)
        agg = fleet.aggregate(rows)      # (a fleet read from Prometheus: its PromQL figures)
        self.query_one("#fleet-summary", Static).update(Content.from_markup(
            summary(agg, width)))
        shown = sort_rows(filter_rows(rows, self.filter_text), self.sort_key, self.reverse)
        self._set_columns(self.app.size.width)
        self._fill(shown, frame.now)
        found = findings(rows, frame.now)
        box = self.query_one("#fleet-findings", Static)
        box.display = bool(found)
        box.update(Content.from_markup("\n".join(
            f"[{'$error' if f.level == 'critical' else '$warning'}]![/] "
            f"{fmt.escape(fmt.clip(f.message, width - 2))}" for f in found[:4])))
        others = sorted({r.kind for r in rows if r.readonly})
        # Said first, so that no width cuts it: which engines cannot be changed from here.
        self.query_one("#fleet-hint", Static).update(Content.from_markup(fmt.fit([
            *([f"[$warning]{', '.join(others)}: watched only[/]"] if others else []),
            f"[$text-muted]{len(shown)} of {len(rows)} engines"
            + (f" · filter {fmt.escape(self.filter_text)}" if self.filter_text else "")
            + f" · sort {self.sort_key}{' ↑' if self.reverse else ''}"
            + (" · by model" if self.grouped else "") + "[/]",
            "[$text-muted]enter drill in · esc back · / filter · s sort · g group · "
            "e change all[/]"],
            width, "  ")))

    def _fill(self, rows: list[FleetRow], now: float) -> None:
        table: DataTable[Any] = self.table
        lines: list[tuple[str, dict[str, str]]] = []
        if self.grouped:
            for model, members in group_by_model(rows):
                lines.append((f"group:{model}", _group_cells(model, members)))
                lines += [(r.name, cells(r, now)) for r in members]
        else:
            lines = [(r.name, cells(r, now)) for r in rows]
        self.rows = {r.name: r for r in rows}
        keys = [k for k, _ in lines]
        shown = {(k, c): (v, getattr(self.rows.get(k), "state", None))
                 for k, texts in lines for c, v in texts.items()}
        if keys != self.row_keys:
            cursor = table.cursor_row
            table.clear()
            for k, texts in lines:
                row = self.rows.get(k)
                table.add_row(*(_style(c, texts[c], row) for _, c, _ in self.columns), key=k)
            self.row_keys, self.shown = keys, shown
            if keys:
                table.move_cursor(row=min(cursor, len(keys) - 1))
            return
        for k, texts in lines:
            for _, c, _ in self.columns:
                if self.shown.get((k, c)) != shown[(k, c)]:
                    table.update_cell(k, c, _style(c, texts[c], self.rows.get(k)))
        self.shown = shown

    # --- actions -----------------------------------------------------------------------------

    def selected_row(self) -> FleetRow | None:
        i = self.table.cursor_row
        if not 0 <= i < len(self.row_keys):
            return None
        return self.rows.get(self.row_keys[i])

    def action_drill(self) -> None:
        row = self.selected_row()
        if row is None:
            return
        note = getattr(self.host.fleet, "drill_note", None)
        if row.engine_key is None:
            self.notify(f"{row.name}: {note}" if note else
                        f"{row.name}: nothing heard from it yet ({row.state})"
                        + (f": {row.problem}" if row.problem else ""),
                        title="Fleet", severity="warning")
            return
        self.host.drill_in(row.engine_key)

    def action_sort_next(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        self.console.refresh_view(force=True)

    def action_sort_reverse(self) -> None:
        self.reverse = not self.reverse
        self.console.refresh_view(force=True)

    def action_group(self) -> None:
        self.grouped = not self.grouped
        self.console.refresh_view(force=True)

    # --- one change for every engine of ours (`vconsole.console.sources.fleet.control`) ---------

    def action_fleet_set(self) -> None:
        if self.console.steering.readonly_reason == "--readonly":
            self.notify("read-only console (--readonly): nothing is changed from here",
                        title="Fleet", severity="warning")
            return
        box = self.query_one("#fleet-set", Input)
        box.add_class("-shown")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#fleet-set", Input)
        if box.has_class("-shown"):
            box.remove_class("-shown")
            self.table.focus()
            return
        super().action_clear_filter()

    @on(Input.Submitted, "#fleet-set")
    def _fleet_set_submitted(self, event: Input.Submitted) -> None:
        event.input.remove_class("-shown")
        self.table.focus()
        fleet = self.host.fleet
        if fleet is None or not event.value.strip():
            return
        try:
            values = parse_pairs(event.value.split())
        except ValueError as e:
            self.notify(str(e), title="Fleet", severity="error")
            return
        ours, others = split(fleet.targets, resolve_auto=False)
        change = " ".join(f"{k}={v}" for k, v in values.items())
        if not ours:
            self.notify(f"{change}: no engine of ours in this fleet", title="Fleet",
                        severity="warning")
            return
        text = "\n".join([f"{change} on {len(ours)} engine(s), one at a time:",
                          *(f"  {t.name}  {t.url}" for t in ours),
                          *(f"  not touched: {t.name} ({why})" for t, why in others)])
        self.app.push_screen(ConfirmScreen(f"Change {len(ours)} engine(s)?", text,
                                           "Change all"),
                             lambda ok: self._send_all(ours, values) if ok else None)

    def _send_all(self, ours: list[Target], values: dict[str, str]) -> None:
        """Each engine in turn (a worker thread); each one's answer as a notice."""
        def work() -> None:
            applied = 0
            for t in ours:
                ok, lines = set_one(t, values)
                applied += ok
                self.app.call_from_thread(self.notify, "\n".join(lines), title=t.name,
                                          severity="information" if ok else "error")
            self.app.call_from_thread(self.notify,
                                      f"{applied} of {len(ours)} engine(s) applied the change",
                                      title="Fleet")
        self.run_worker(work, thread=True, group="fleet-set")


def tab_status(fleet: Fleet, state: ConsoleState) -> str:
    """The tab bar's right on the Fleet screen: how many engines are up (markup)."""
    rows = fleet.rows(state, state.now())
    up = sum(r.state == "up" for r in rows)
    style = "$success" if up == len(rows) else ("$error" if not up else "$warning")
    return f"[{style}]● {up}/{len(rows)} up[/]"


def summary(agg: FleetAggregate, width: int) -> str:
    def n(v: float | None) -> str:
        return "–" if v is None else f"{v:.0f}"
    return fmt.fit([
        f"[b]fleet[/] {agg.engines_up}/{agg.engines} up",
        f"run {n(agg.running)} · wait {n(agg.waiting)}",
        f"KV {fmt.pct(agg.kv_usage, 0)}",
        f"{n(agg.gen_tok_s)} tok/s",
        f"TTFT p50 {percentile_text(agg.ttft_p50)} p99 {percentile_text(agg.ttft_p99)}",
        f"ITL p99 {percentile_text(agg.itl_p99)}",
        "[$text-muted](merged buckets)[/]"], width)


def _group_cells(model: str, members: list[FleetRow]) -> dict[str, str]:
    up = [r for r in members if r.state == "up"]
    total = {c: "" for _, c, _ in WIDE}

    def s(vals: list[float | None]) -> str:
        known = [v for v in vals if v is not None]
        return f"{sum(known):.0f}" if known else "–"
    total.update(name=f"▸ {model.split('/')[-1]}", state=f"{len(up)}/{len(members)} up",
                 running=s([r.running for r in up]), waiting=s([r.waiting for r in up]),
                 tok=s([r.gen_tok_s for r in up]))
    return total


def _style(column: str, text: str, row: FleetRow | None) -> Any:
    if row is None:
        return Content.from_markup(f"[b]{fmt.escape(text)}[/]")
    if column == "state":
        return Content.from_markup(f"[{STATE_STYLE.get(row.state, '')}]{fmt.escape(text)}[/]")
    if column == "alerts" and text:
        return Content.from_markup(f"[$warning]{fmt.escape(text)}[/]")
    return text
