"""A screen with a ``/`` filter: the Requests, Config and Alerts screens.

The filter is an Input with the class ``filter-input`` (hidden until ``/``), applied live while
typed (`set_filter`), kept on enter, cleared by ``esc``; focus then goes back to the screen's
table. A screen says what filtering means by overriding `set_filter`. With no filter to clear,
``esc`` goes back to the Fleet screen (the app's ``fleet_back``; nothing without a fleet).
"""

from __future__ import annotations

from textual import on
from textual.widgets import Input

from vconsole.console.screens.base import ConsoleScreen


class FilteredScreen(ConsoleScreen):
    filter_text = ""

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip()
        self.console.refresh_view(force=True)

    def _filter_box(self) -> Input:
        return self.query_one(".filter-input", Input)

    def action_filter(self) -> None:
        box = self._filter_box()
        box.add_class("-shown")
        box.value = self.filter_text
        box.focus()

    @on(Input.Changed, ".filter-input")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.set_filter(event.value)

    @on(Input.Submitted, ".filter-input")
    def _filter_done(self) -> None:
        self._filter_box().remove_class("-shown")
        self.table.focus()

    def action_clear_filter(self) -> None:
        box = self._filter_box()
        if not self.filter_text and not box.has_class("-shown"):
            # Nothing to clear: esc means back (to the Fleet screen, when there is one).
            self.call_later(self.run_action, "app.fleet_back")
            return
        box.value = ""
        box.remove_class("-shown")
        self.set_filter("")
        self.table.focus()


