"""Requests: every live request, sortable and filterable, virtualised for thousands of rows.

``enter`` opens the detail pane on the cursor's request (`RequestDetail`: its figures, prompt
head and output tail when the engine publishes text); the pane follows the cursor as it moves,
stays on its request while rows move under it, shows the last it saw once the request has left
the table, and ``esc`` closes it (a second ``esc`` clears the filter, as before)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Input, Static

from vconsole.console import format as fmt
from vconsole.console import spec_view
from vconsole.console.keymap import REQUESTS
from vconsole.console.requests_view import SORT_KEYS, TITLES, not_understood, select
from vconsole.console.screens.filtered import FilteredScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.request_detail import RequestDetail
from vconsole.console.widgets.request_table import RequestTable, header_text
from vconsole.telemetry import request_text
from vconsole.telemetry.request_text import RequestText
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
        self.detail_id: str | None = None     # the request the open pane shows (None: closed)
        self._detail_seen: tuple[dict[str, Any], RequestText | None] | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="req-summary")
        yield Static(id="req-header")
        yield RequestTable(id="req-table")
        yield RequestDetail(id="req-detail")
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
        self._show_detail()

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
            if sc.get("num_compiling"):     # structured outputs whose grammar compiles now
                parts.append(f"[$accent]{fmt.count(sc.get('num_compiling'))}[/] compiling")
            spec = spec_view.summary(sc)    # speculative decoding, where configured
            if spec is not None:
                parts.append(spec)
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

    def _show_detail(self) -> None:
        """The open pane's request as the shown snapshot has it (or as last seen)."""
        rid = self.detail_id
        if rid is None:
            return
        snap = self._source if isinstance(self._source, dict) else None
        src = _columns((snap or {}).get("requests"))
        at = src.index_of(rid)
        pane = self.query_one(RequestDetail)
        published = request_text.published(snap)
        if at is not None:
            row, text = src.row(at), request_text.text_of(snap, rid)
            if self._detail_seen is None or self._detail_seen[0].get("id") != rid \
                    or text is not None:
                self._detail_seen = (row, text)
            else:           # text not in this snapshot: keep what was seen
                self._detail_seen = (row, self._detail_seen[1])
            spec = spec_view.of_request(snap, rid)
            if spec is not None:
                row = {**row, "spec": spec}
            pane.show(row, self._detail_seen[1], published=published)
        elif self._detail_seen is not None and self._detail_seen[0].get("id") == rid:
            pane.show(self._detail_seen[0], self._detail_seen[1], published=published,
                      gone=True)
        else:
            pane.show(None, None, published=published)

    def _open_detail(self, request_id: str | None) -> None:
        self.detail_id = request_id
        self._detail_seen = None
        self.query_one(RequestDetail).add_class("-open")
        self._show_detail()

    def on_request_table_cursor_moved(self, event: RequestTable.CursorMoved) -> None:
        if self.detail_id is not None:
            self._open_detail(event.request_id)

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

    def action_detail(self) -> None:
        """``enter``: the detail pane on the cursor's request."""
        self._open_detail(self.table.cursor_id)

    def action_close(self) -> None:
        """``esc``: close the detail pane, else clear the filter."""
        if self.detail_id is not None:
            self.detail_id = None
            self._detail_seen = None
            self.query_one(RequestDetail).remove_class("-open")
            self.table.focus()
            return
        self.action_clear_filter()

    def action_sort_next(self) -> None:
        i = SORT_KEYS.index(self.sort_key) if self.sort_key in SORT_KEYS else -1
        key = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        self.set_sort(key, reverse=key not in ("id", "state"))

    def action_sort_reverse(self) -> None:
        self.set_sort(self.sort_key, not self.reverse)

    def sort_label(self) -> str:
        return TITLES.get(self.sort_key, self.sort_key)
