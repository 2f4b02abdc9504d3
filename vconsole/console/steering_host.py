"""The contract between `vconsole.console.steering.Steering` and the UI that drives it.

Steering never blocks the UI thread and never touches Textual: it hands its blocking calls to a
`SteeringHost` (`vconsole.console.app.VConsoleApp`: Textual worker threads; the tests: an
inline host that runs them at once), and each worker hands its result back as a step the host
runs on the UI thread; the step returns the `Update` the UI shows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vconsole.console.changes import ChangeRecord
from vconsole.console.plans import Notice


@dataclass(frozen=True)
class Update:
    """What the UI shows when a worker's result is in (always: the screen, refreshed)."""

    notice: Notice | None = None
    record: ChangeRecord | None = None     # a config change answered (refusals show inline)
    readonly_changed: bool = False         # the keys a read-only console hides changed


class SteeringHost(Protocol):
    """What Steering needs from the UI it serves (`VConsoleApp`)."""

    def run_blocking(self, work: Callable[[threading.Event], None], *, group: str,
                     exclusive: bool = False) -> None:
        """Run ``work`` off the UI thread; its event is set when the UI no longer waits for it
        (it quits, or ``exclusive`` work of the same group replaced it)."""

    def from_worker(self, step: Callable[[], Update]) -> None:
        """From a worker thread: run ``step`` on the UI thread and show what it returns."""
