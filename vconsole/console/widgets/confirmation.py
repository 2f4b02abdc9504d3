"""A confirmation box for changes that can hurt (Posting's `ModalScreen[bool]`, nvitop's habit).

It spells out the consequence and has no single-key yes: focus starts on Cancel, Escape cancels,
and confirming takes a deliberate move to the confirm button (tab / arrow) and Enter.
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("left,right", "app.focus_next", "Switch", show=False),
    ]

    def __init__(self, title: str, consequence: str, confirm_label: str = "Apply change"
                 ) -> None:
        super().__init__()
        self.title_text = title
        self.consequence = consequence
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(Content(self.title_text), id="confirm-title")
            yield Static(Content(self.consequence), id="confirm-text")
            yield Static(Content.from_markup(
                "[$text-muted]tab to choose, enter to press, esc to cancel[/]"),
                id="confirm-hint")
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel", id="cancel", variant="default")
                yield Button(self.confirm_label, id="confirm", variant="warning")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed, "#confirm")
    def _confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(False)

    def action_cancel(self) -> None:
        self.dismiss(False)
