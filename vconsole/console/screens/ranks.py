"""Ranks (``6``, data parallel only): every rank of the group on one line, under the aggregate.

The top says what the group does as a whole (summed queues and tokens/s, blocks-weighted KV
usage, phases, dummy-step share, wave, process-group state) and how unevenly the load is spread
(max / mean of waiting + running, highlighted past `vconsole.console.ranks.IMBALANCE_WARN`).
Below, one row per rank, scrolling when there are more ranks than lines (8 ranks fit at 80x24);
the cursor row is the selected engine, so every other screen shows that rank, and ``enter``
opens its KV map. A rank the group's size names but that was never heard shows as such; one
that is down or restarting shows its state, for how long and why, with dashes for its figures
(its last ones are not live, and the aggregate leaves it out). Ranks that are Ray actors
(``--data-parallel-backend ray``) get one more line: each rank's actor and node; a restarted
actor shows as any restarted rank does (``restarting``, reason, count).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.engine_state import EngineState
from vconsole.console.keymap import RANKS
from vconsole.console.ranks import placement, placement_line, rank_load
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets import dp_panels
from vconsole.console.widgets.chrome import Frame


class RankRow(Static):
    """One rank's line (``index``: its row, from 0)."""

    def __init__(self, index: int) -> None:
        super().__init__(classes="rank-row")
        self.index = index


class RanksScreen(ConsoleScreen):
    MODE = "dp"
    BINDINGS = RANKS

    def __init__(self) -> None:
        super().__init__()
        self.cursor = 0
        self.rank_keys: list[str | None] = []   # engine key per row (None: not heard yet)

    def compose_body(self) -> ComposeResult:
        yield Static(id="dp-summary")
        yield Static(id="dp-header")
        # Not focusable: the screen's keys move the cursor, and scroll to keep it in view.
        yield VerticalScroll(id="dp-rows", can_focus=False)
        where = Static(id="dp-where")      # Ray actor ranks: which actor, on which node
        where.styles.height = 1
        where.styles.padding = (0, 1)
        where.display = False
        yield where
        yield Static(id="dp-hint")

    @property
    def rows_box(self) -> VerticalScroll:
        return self.query_one("#dp-rows", VerticalScroll)

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        width = max(20, self.app.size.width - 2)
        ranks = state.dp_ranks(frame.engine)
        summary = self.query_one("#dp-summary", Static)
        if not ranks:
            summary.update(Content.from_markup(
                "[$text-muted]not a data-parallel engine: no rank has sent the dp topic[/]"))
            self._set_rows([], [])
            return
        agg = state.dp_aggregate(ranks, frame.now)
        summary.update(Content.from_markup("\n".join(dp_panels.aggregate_lines(agg, width))))
        self.query_one("#dp-header", Static).update(Content.from_markup(
            dp_panels.header(width)))
        by_rank = {e.rank: e for e in ranks}
        size = max(agg["world_size"], max(by_rank) + 1)
        order: list[EngineState | None] = [by_rank.get(r) for r in range(size)]
        order += [e for e in ranks if e.rank >= size]
        left_out = set(agg.get("left_out") or ())
        loads = [v for e in ranks if e.rank not in left_out
                 and (v := rank_load(e.live_bodies())) is not None]
        max_load = max(loads, default=0.0)
        texts = [dp_panels.rank_row(e, agg, frame.now, width, max_load) if e is not None
                 else dp_panels.missing_row(r) for r, e in enumerate(order)]
        self._set_rows([e.key if e is not None else None for e in order], texts)
        eng = frame.engine
        here = self.rank_keys[self.cursor] if self.rank_keys else None
        if eng is not None and here is not None and here != eng.key and \
                eng.key in self.rank_keys:   # selected elsewhere (n, the KV map's [ ])
            self.cursor = self.rank_keys.index(eng.key)
        self._show_cursor()
        where = placement_line(placement({e.rank: e.latest for e in ranks}))
        box = self.query_one("#dp-where", Static)
        box.display = bool(where)
        if where:
            box.update(Content(fmt.fit(["Ray actors:", *where], width, "  ")))
        self.query_one("#dp-hint", Static).update(Content.from_markup(fmt.fit([
            f"[$text-muted]{len(ranks)} of {size} ranks heard[/]",
            "[$text-muted]↑↓ select · enter KV map · [ ] on the KV map cycles ranks[/]"],
            width, "  ")))

    def _set_rows(self, keys: list[str | None], texts: list[str]) -> None:
        rows = list(self.query(RankRow))
        if len(rows) != len(texts):
            for row in rows[len(texts):]:
                row.remove()
            new = [RankRow(i) for i in range(len(rows), len(texts))]
            if new:
                self.rows_box.mount_all(new)
            rows = rows[:len(texts)] + new
        self.rank_keys = keys
        for row, text in zip(rows, texts, strict=True):
            row.update(Content.from_markup(text))
        self.cursor = min(self.cursor, max(0, len(texts) - 1))

    def _show_cursor(self) -> None:
        for row in self.query(RankRow):
            row.set_class(row.index == self.cursor, "-cursor")

    # --- actions -----------------------------------------------------------------------------

    def _select(self, index: int) -> None:
        if not self.rank_keys:
            return
        self.cursor = max(0, min(len(self.rank_keys) - 1, index))
        key = self.rank_keys[self.cursor]
        if key is not None:
            self.console.selected_engine = key
        self._show_cursor()
        rows = list(self.query(RankRow))
        if self.cursor < len(rows):
            self.rows_box.scroll_to_widget(rows[self.cursor], animate=False)
        self.console.refresh_view(force=True)

    def action_cursor(self, step: int) -> None:
        self._select(self.cursor + step)

    def action_jump(self, index: int) -> None:
        self._select(index if index >= 0 else len(self.rank_keys) - 1)

    def action_open_kv(self) -> None:
        if self.rank_keys and self.rank_keys[self.cursor] is not None:
            self.console.selected_engine = self.rank_keys[self.cursor]
            self.console.action_show("kv")
