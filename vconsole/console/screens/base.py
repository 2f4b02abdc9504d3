"""The base of every console screen: shared chrome and the one entry point for new data.

The app calls `ConsoleScreen.refresh_view` for the visible screen only, inside
``app.batch_update()`` and under the state's lock, at most ``refresh_hz`` times a second. A
screen never reads the socket or the clock itself; what else it needs it asks of its host
(``console``, a `vconsole.console.screen_host.ScreenHost`), never of the app's own type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from textual.app import ComposeResult
from textual.containers import Container
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer

from vconsole.console.screen_host import ScreenHost
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Banner, Frame, TabBar, TooSmall


class ConsoleScreen(Screen[None]):
    MODE = ""
    # A list screen: the id of its DataTable (made with `row_table`) and its (label, key)
    # columns, added and focused on mount.
    TABLE = ""
    COLUMNS: Sequence[tuple[str, str]] = ()

    @property
    def table(self) -> Any:
        """The list screen's table, where focus returns after a filter or an edit."""
        return self.query_one(f"#{self.TABLE}", DataTable)

    def on_mount(self) -> None:
        if self.TABLE:
            add_columns(self.table, self.COLUMNS)
            self.table.focus()

    @property
    def console(self) -> ScreenHost:
        """The app, as what a screen may ask of it."""
        return cast(ScreenHost, self.app)

    def compose(self) -> ComposeResult:
        yield TabBar(id="tabbar")
        yield Banner(id="banner")
        with Container(id="body"):
            yield from self.compose_body()
        yield TooSmall(id="too-small")
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def refresh_view(self, frame: Frame, state: ConsoleState) -> None:
        try:
            tabbar, banner = self.query_one(TabBar), self.query_one(Banner)
        except NoMatches:
            return  # torn down while the app exits (a last timer tick): nothing to show
        tabbar.show(frame)
        try:
            self.apply(frame, state)
        except Exception as e:  # a payload we cannot show must not take the console down
            self.log.error(f"{type(self).__name__}.apply failed: {e!r}")
            frame.last_error = f"cannot show this data ({type(e).__name__}: {e})"
        banner.show(frame)

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        """Show the latest state (subclasses)."""

    def on_screen_resume(self) -> None:
        self.console.note_size()
        self.console.refresh_view(force=True)

    def on_resize(self) -> None:
        # The app swallows its own Resize event; every screen gets one, so size is checked here.
        self.console.note_size()
        self.console.refresh_view(force=True)


def row_table(table_id: str) -> DataTable[Any]:
    """A list screen's table: a row cursor, no zebra stripes."""
    return DataTable(id=table_id, cursor_type="row", zebra_stripes=False)


def add_columns(table: DataTable[Any], columns: Sequence[tuple[str, str]]) -> None:
    """``(label, key)`` columns in order; rows are later addressed by those keys."""
    for label, key in columns:
        table.add_column(label, key=key)
