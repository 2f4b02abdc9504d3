"""A virtualised table of live requests: renders only the visible lines (Toolong's pattern).

Why not DataTable: replacing thousands of rows ten times a second through ``update_cell`` costs
~100 ms per tick. Here `set_view` takes the decoded columns and a row order (an index array,
`vconsole.console.requests_view.select`) and `render_line` builds and formats just the lines on
screen, so the cost per refresh is independent of the number of rows. The cursor follows the
request id it is on when rows move under it; a move made by a key (not by new rows) posts
`RequestTable.CursorMoved`. ``rows`` reads as a sequence of row maps in view
order (built on access).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from vconsole.console import format as fmt
from vconsole.console.keymap import TABLE
from vconsole.console.requests_view import Column, grammar_label, layout
from vconsole.telemetry.schema import RequestColumns

STATE_CLASSES = {"running": "request-table--running", "waiting": "request-table--waiting",
                 "preempted": "request-table--preempted",
                 "compiling": "request-table--compiling"}


def cell_text(col: Column, value: Any, width: int) -> str:
    if col.key == "constraint":
        return f"{fmt.clip(str(value or ''), width - 1):<{width}}"
    if value is None:
        text = "–"
    elif col.key == "age_s":
        text = fmt.duration(float(value))
    elif col.numeric and isinstance(value, int | float):
        text = f"{value:,.0f}" if isinstance(value, float) else f"{value:,}"
    else:
        text = str(value)
    text = fmt.clip(text, width - 1)
    return f"{text:<{width}}" if not col.numeric else f"{text:>{width - 1}} "


def header_text(width: int, sort_key: str, reverse: bool) -> list[tuple[str, bool]]:
    """(cell text, is the sort column) per column, for the header line."""
    out = []
    for col, w in layout(width):
        title = col.title + ((" ↓" if reverse else " ↑") if col.key == sort_key else "")
        title = fmt.clip(title, w - 1)
        out.append((f"{title:<{w}}" if not col.numeric else f"{title:>{w - 1}} ",
                    col.key == sort_key))
    return out


class RowsView(Sequence[dict[str, Any]]):
    """The rows of ``cols`` in ``order``, as row maps built on access."""

    __slots__ = ("cols", "order")

    def __init__(self, cols: RequestColumns, order: np.ndarray) -> None:
        self.cols = cols
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self.cols.row(int(j)) for j in self.order[i]]
        return self.cols.row(int(self.order[i]))

    def __eq__(self, other: object) -> bool:
        """Equal to a list of the same row maps in the same order."""
        if isinstance(other, RowsView | list):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def id_at(self, i: int) -> str:
        return self.cols.ids[int(self.order[i])]

    def position(self, request_id: str) -> int | None:
        """Where ``request_id`` is in this view (None: not in it)."""
        src = self.cols.index_of(request_id)
        if src is None:
            return None
        where = np.flatnonzero(self.order == src)
        return int(where[0]) if len(where) else None


class RequestTable(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"request-table--cursor", "request-table--running",
                         "request-table--waiting", "request-table--preempted",
                         "request-table--compiling", "request-table--muted"}
    BINDINGS = TABLE

    cursor: reactive[int] = reactive(0, repaint=False)

    class CursorMoved(Message):
        """The operator moved the cursor onto ``request_id``."""

        def __init__(self, request_id: str) -> None:
            super().__init__()
            self.request_id = request_id

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows = RowsView(RequestColumns.from_rows([]), np.zeros(0, np.intp))
        self.cursor_id: str | None = None

    def set_rows(self, rows: Sequence[dict[str, Any]]) -> None:
        """Show ``rows`` (row maps, already filtered and sorted)."""
        self.set_view(RequestColumns.from_rows(list(rows)), np.arange(len(rows)))

    def set_view(self, cols: RequestColumns, order: np.ndarray) -> None:
        """Show the rows of ``cols`` in ``order``; keeps the cursor on its request."""
        rows = self.rows = RowsView(cols, order)
        if self.cursor_id is not None:
            at = rows.position(self.cursor_id)
            if at is not None:
                self.cursor = at
        self.cursor = min(self.cursor, max(0, len(rows) - 1))
        self.cursor_id = rows.id_at(self.cursor) if len(rows) else None
        self.virtual_size = Size(self.scrollable_content_region.width, len(rows))
        self._keep_cursor_visible()
        self.refresh()

    def _keep_cursor_visible(self) -> None:
        height = self.scrollable_content_region.height
        if height <= 0:
            return
        top = round(self.scroll_y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)

    def move_cursor(self, index: int) -> None:
        if not self.rows:
            return
        self.cursor = max(0, min(len(self.rows) - 1, index))
        self.cursor_id = self.rows.id_at(self.cursor)
        self._keep_cursor_visible()
        self.refresh()
        self.post_message(self.CursorMoved(self.cursor_id))

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self.cursor + delta)

    def action_page(self, delta: int) -> None:
        self.move_cursor(self.cursor + delta * max(1, self.scrollable_content_region.height - 1))

    def action_jump(self, where: int) -> None:
        self.move_cursor(0 if where == 0 else len(self.rows) - 1)

    def on_resize(self) -> None:
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.rows))

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        idx = round(self.scroll_y) + y
        if idx >= len(self.rows):
            return Strip.blank(width, base)
        row = self.rows[idx]
        cursor: Style | None = None
        if idx == self.cursor:
            cursor = (self.get_component_rich_style("request-table--cursor") if self.has_focus
                      else Style(underline=True))
        segments = []
        for col, w in layout(width):
            value = grammar_label(row) if col.key == "constraint" else row.get(col.key)
            style = base
            if col.key == "state":
                cls = STATE_CLASSES.get(str(value))
                if cls:
                    style = base + self.get_component_rich_style(cls, partial=True)
            elif col.key == "age_s" or (col.key == "priority" and value == 0):
                style = base + self.get_component_rich_style("request-table--muted",
                                                             partial=True)
            if cursor is not None:
                style = style + cursor
            segments.append(Segment(cell_text(col, value, w), style))
        return Strip(segments).adjust_cell_length(width, base + cursor if cursor else base)

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
