"""A confirmation box for changes that can hurt (Posting's `ModalScreen[bool]`, nvitop's habit).

It spells out the consequence and has no single-key yes: focus starts on Cancel, Escape cancels,
and confirming takes a deliberate move to the confirm button (tab / arrow) and Enter.

A `vconsole.console.forecast.Forecast` adds lines the box computes while the operator reads
it (a config change's predicted effect): its first text at once, then what its
``work`` returns, run in a thread worker of the box. Nothing waits on it: confirming or
cancelling dismisses the box and its worker's result is dropped.
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static
from textual.worker import get_current_worker

from vconsole.console.forecast import Forecast


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("left,right", "app.focus_next", "Switch", show=False),
    ]

    def __init__(self, title: str, consequence: str, confirm_label: str = "Apply change",
                 forecast: Forecast | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.consequence = consequence
        self.confirm_label = confirm_label
        self.forecast = forecast
        self.forecast_text = forecast.first if forecast else ""   # what the box shows now

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="-forecast" if self.forecast else ""):
            yield Static(Content(self.title_text), id="confirm-title")
            yield Static(Content(self.consequence), id="confirm-text")
            if self.forecast is not None:
                yield Static(Content.from_markup(self.forecast.first), id="confirm-forecast")
            yield Static(Content.from_markup(
                "[$text-muted]tab to choose, enter to press, esc to cancel[/]"),
                id="confirm-hint")
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel", id="cancel", variant="default")
                yield Button(self.confirm_label, id="confirm", variant="warning")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()
        if self.forecast is not None and self.forecast.work is not None:
            self.run_worker(self._work_forecast, thread=True, group="forecast")

    def _work_forecast(self) -> None:
        assert self.forecast is not None and self.forecast.work is not None
        try:
            text = self.forecast.work()
        except Exception as e:  # a forecast that fails must not take the box down
            text = Content(f"no prediction: {type(e).__name__}: {e}").markup
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show_forecast, text)

    def _show_forecast(self, text: str) -> None:
        self.forecast_text = text
        if self.is_attached:
            self.query_one("#confirm-forecast", Static).update(Content.from_markup(text))

    @on(Button.Pressed, "#confirm")
    def _confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(False)

    def action_cancel(self) -> None:
        self.dismiss(False)
