"""A profile run as the console follows it: started on the engine, polled, its result kept.

The engine's side is the control ops ``profile_start`` / ``profile_status`` / ``profile_cancel``
(docs/PROTOCOL.md, *Profiling*). `vconsole.console.steering.Steering` makes a `ProfileRun` once
the operator confirmed (`consequence` is what the box says), and `follow` drives it from a worker
thread, so a run goes on while the operator looks at other screens; the Profile screen
(`vconsole.console.screens.profile`) only draws ``app.steering.profile_run``.

Invariants: only `follow`'s thread writes a run (`take`, `fail`), the UI thread only reads it;
``generation`` grows with every change the screen should show; a run is over (``active``
false) exactly once, in one of ``done``, ``cancelled``, ``failed`` (the engine's word) or
``error`` (the console could not reach the engine or was refused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vconsole.wire.control_client import NotAuthorised

if TYPE_CHECKING:
    from vconsole.console.control_link import Control

STEP_CHOICES = (10, 20, 50, 100, 200)    # + / - on the Profile screen; the engine allows 1..200
DEFAULT_STEPS = 20
POLL_S = 0.25
MAX_POLL_FAILURES = 12                   # ~ this many unanswered polls in a row: stop following

STARTING, RUNNING, DONE, CANCELLED, FAILED, ERROR = (
    "starting", "running", "done", "cancelled", "failed", "error")


def consequence(steps: int) -> str:
    """What profiling ``steps`` steps does to the engine: the confirmation box's text."""
    return (f"torch.profiler records every operator of the engine's next {steps} steps and "
            "every layer is labelled while it runs: those steps run slower, and building the "
            "report afterwards slows the engine a little longer. Requests keep being served "
            "and their tokens do not change. c cancels.")


@dataclass
class ProfileRun:
    steps: int
    state: str = STARTING
    id: str | None = None
    steps_done: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None
    note: str = ""                        # the engine's word on the slowdown
    moved: float = field(default_factory=time.monotonic)   # when steps_done last changed
    generation: int = 0

    @property
    def active(self) -> bool:
        return self.state in (STARTING, RUNNING)

    def take(self, status: dict[str, Any]) -> bool:
        """Fold in the engine's status of this profile; whether anything changed."""
        before = (self.state, self.steps_done, self.id)
        self.id = status.get("id", self.id)
        self.note = status.get("slowdown_note") or self.note
        done = int(status.get("steps_done") or 0)
        if done != self.steps_done:
            self.steps_done, self.moved = done, time.monotonic()
        self.result = status.get("result") or self.result
        self.error = status.get("error")
        self.state = str(status.get("state") or RUNNING)
        changed = (self.state, self.steps_done, self.id) != before
        if changed:
            self.generation += 1
        return changed

    def fail(self, error: str) -> None:
        self.error, self.state = error, ERROR
        self.generation += 1


def follow(control: Control, run: ProfileRun, cancelled: threading.Event,
           changed: Callable[[], None]) -> None:
    """Start ``run`` on the engine, then poll it until it is over or ``cancelled`` is set;
    ``changed()`` after each visible change. Raises NotAuthorised when the engine refuses the
    console's key (the run is marked ``error`` first); other failures end up in the run."""
    try:
        run.take(control.profile_start(run.steps))
    except NotAuthorised as e:
        run.fail(str(e))
        raise
    except Exception as e:  # TimeoutError, ControlError (one is running), zmq errors
        run.fail(str(e) or type(e).__name__)
        changed()
        return
    changed()
    failures = 0
    while run.active and run.id is not None and not cancelled.wait(POLL_S):
        try:
            status = control.profile_status(run.id)
        except Exception as e:
            failures += 1
            if failures >= MAX_POLL_FAILURES:
                run.fail(f"lost the engine while profile {run.id} ran: {e}")
                changed()
                return
            continue
        failures = 0
        if run.take(status):
            changed()
