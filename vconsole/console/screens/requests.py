"""Requests: every live request, sortable and filterable, virtualised for thousands of rows."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Input, Static

from vconsole.console import format as fmt
from vconsole.console.keymap import REQUESTS
from vconsole.console.requests_view import SORT_KEYS, TITLES, not_understood, select
from vconsole.console.screens.filtered import FilteredScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.request_table import RequestTable, header_text
from vconsole.telemetry.schema import RequestColumns


def _columns(requests: Any) -> RequestColumns:
    """The snapshot's table as columns (`decode` gives them; a hand-built payload may not)."""
    if isinstance(requests, RequestColumns):
        return requests
    return RequestColumns.from_rows(list(requests or []))


class RequestsScreen(FilteredScreen):
    MODE = "requests"
    BINDINGS = REQUESTS

    def __init__(self) -> None:
        super().__init__()
        self.sort_key = "age_s"
        self.reverse = True
        self.filter_text = ""
        self.total_rows = 0
        self._source: Any = None
        self._view_key: tuple[Any, ...] | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="req-summary")
        yield Static(id="req-header")
        yield RequestTable(id="req-table")
        yield Input(placeholder="filter: words, state:running, prio>0, age>30 — enter keeps, "
                                "esc clears", id="req-filter", classes="filter-input")

    @property
    def table(self) -> RequestTable:
        return self.query_one(RequestTable)

    def on_mount(self) -> None:
        self.table.focus()

    # --- data ------------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        eng = frame.engine
        sc = eng.latest.get("sched") if eng else None
        if not frame.paused or self._source is None:
            self._source = sc
        src = _columns((self._source or {}).get("requests"))
        # An idle engine re-sends its last snapshot every heartbeat (same ``snapshot_ts``):
        # the same rows, so 10k rows are not filtered and sorted again for nothing.
        snap = self._source or {}
        key = (snap.get("snapshot_ts", id(self._source)), len(src), self.filter_text,
               self.sort_key, self.reverse, self.table.scrollable_content_region.width)
        if key != self._view_key:
            self._view_key = key
            self.table.set_view(src, select(src, self.filter_text, self.sort_key,
                                            self.reverse))
            self.total_rows = len(src)
        self._show_header()
        self._show_summary(sc, frame)

    def _show_header(self) -> None:
        width = self.table.scrollable_content_region.width or self.size.width
        parts = [f"[b $accent]{fmt.escape(t)}[/]" if is_sort else f"[b]{fmt.escape(t)}[/]"
                 for t, is_sort in header_text(width, self.sort_key, self.reverse)]
        self.query_one("#req-header", Static).update(Content.from_markup("".join(parts)))

    def _show_summary(self, sc: dict[str, Any] | None, frame: Frame) -> None:
        if sc is None:
            text = "[$text-muted]no scheduler snapshot yet[/]"
        else:
            shown = len(self.table.rows)
            parts = [f"[$warning]{fmt.count(sc.get('num_waiting'))}[/] waiting",
                     f"[$success]{fmt.count(sc.get('num_running'))}[/] running",
                     f"[$error]{fmt.count(sc.get('num_preempted'))}[/] preempted"]
            view = f"{shown:,} of {self.total_rows:,} shown" if self.filter_text else \
                f"{self.total_rows:,} rows"
            if sc.get("requests_truncated"):
                view += " [$warning](engine sends the first rows only)[/]"
            if "requests" in (sc.get("not_exposed") or ()):
                view = f"rows: not exposed by {fmt.escape(fmt.source_name(sc.get('source')))}"
            parts.append(f"[$text-muted]{view}[/]")
            bad = not_understood(self.filter_text)
            if bad:     # first, so that a narrow terminal still shows it
                parts.insert(0, f"[$warning b]not understood, ignored: "
                                f"{fmt.escape(' '.join(bad))}[/]")
            if self.filter_text:
                parts.append(f"filter [b]{fmt.escape(self.filter_text)}[/]")
            if bad:
                parts.append("[$text-muted]compare a number column: prio>0, age>=30, "
                             "output=0[/]")
            if frame.paused:
                parts.append("[$warning b]paused[/]")
            text = " · ".join(parts)
        self.query_one("#req-summary", Static).update(Content.from_markup(text))

    def _reapply(self) -> None:
        self.console.refresh_view(force=True)

    # --- actions ---------------------------------------------------------------------------

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip()
        self._reapply()

    def set_sort(self, key: str, reverse: bool | None = None) -> None:
        self.sort_key = key
        if reverse is not None:
            self.reverse = reverse
        self._reapply()

    def action_sort_next(self) -> None:
        i = SORT_KEYS.index(self.sort_key) if self.sort_key in SORT_KEYS else -1
        key = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        self.set_sort(key, reverse=key not in ("id", "state"))

    def action_sort_reverse(self) -> None:
        self.set_sort(self.sort_key, not self.reverse)

    def sort_label(self) -> str:
        return TITLES.get(self.sort_key, self.sort_key)
