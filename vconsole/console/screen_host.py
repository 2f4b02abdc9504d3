"""What a screen may ask of the app that hosts it: `ScreenHost`.

A screen draws the `Frame` and state the app hands to ``refresh_view`` and asks its host for a
few things more: the models (``state``, ``steering``, ``whatif``), a redraw, the engine the
operator selected, a screen switch, a prediction in a worker, and one way to change the
engine — ``steer(plan)`` with a plan from ``steering``, which shows the confirmation box when
the plan asks for one and returns why it was refused, if it was.

Screens, widgets and the palette type their host as this, never as
`vconsole.console.app.VConsoleApp` (import contract ``console-host``): the app imports the
screens, the screens never import the app, not even for types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from textual.dom import DOMNode

    from vconsole.console.plans import Plan
    from vconsole.console.predictions import Change, Prediction, WhatIf
    from vconsole.console.state import ConsoleState, EngineState
    from vconsole.console.steering import Steering


class ScreenHost(Protocol):
    """See the module docstring (`vconsole.console.app.VConsoleApp` is the one host)."""

    state: ConsoleState
    steering: Steering
    selected_engine: str | None     # an engine's key (None: the first); the Ranks screen sets it

    @property
    def readonly(self) -> bool:
        """Nothing may be changed from this console (``steering.readonly_reason`` says why)."""

    @property
    def whatif(self) -> WhatIf: ...

    def current_engine(self) -> EngineState | None:
        """The selected engine (or the first)."""

    def refresh_view(self, force: bool = False) -> None:
        """Apply the latest state to the visible screen (``force``: now, whatever the pace)."""

    def note_size(self) -> None:
        """Check the terminal's size (a screen gets the resize events the app does not)."""

    def action_show(self, mode: str) -> None:
        """Switch to the screen of ``mode`` (a notice where it does not open)."""

    def action_next_rank(self, step: int) -> None:
        """Select the previous / next rank of the watched data-parallel group."""

    def steer(self, plan: Plan, *, confirmed: bool = False) -> str | None:
        """Carry out a plan of ``steering`` (the box first when it asks); why it was refused,
        or None."""

    def predict_later(self, owner: DOMNode, changes: list[Change],
                      done: Callable[[list[Prediction]], None]) -> None:
        """Predict ``changes`` in a worker of ``owner`` (cancelled with it); ``done`` gets
        the predictions on the UI thread."""
