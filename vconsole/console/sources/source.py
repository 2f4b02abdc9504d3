"""`Source`: what the console asks of whatever feeds it telemetry.

Our engine's stream (`vconsole.console.sources.stream.ZmqSource`), a recording of it
(`ReplaySource`) and a vLLM server (`vconsole.console.sources.vllm.VllmSource`) implement it;
a new kind of engine plugs into the console by implementing it too (a module of its own in
this folder) and nothing else.

The app holds a list of sources, one per engine or group it watches, so a fleet is N sources
and one engine is a list of one. Every source folds what it reads into the app's one
`ConsoleState`, from a thread of its own, under the key of the engine each message names
(``engine/rank``, its envelope's): the state is keyed by engine, never by source, and each
source says which keys it fed (``engine_keys``). The app asks the source of the selected engine
for what the header shows (``describe``, ``live``, the recording, ``error``) and for its
actions; the state's clock is the first source's ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vconsole.console.state import ConsoleState


class ActionError(RuntimeError):
    """A source's server refused an action or did not answer; the message says what, and how
    to enable it where it can be enabled."""


class SourceAction(Protocol):
    """One thing a source's server may be asked to do (`vconsole.console.sources.vllm_actions`
    has a vLLM server's): always behind the confirmation box, which shows ``title`` and
    ``consequence``."""

    @property
    def key(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def consequence(self) -> str: ...


@runtime_checkable
class Source(Protocol):
    """See the module docstring. ``on_data`` is the app's: the source calls it (from its
    thread) after folding in a batch that holds a new snapshot."""

    on_data: Callable[[], None] | None

    @property
    def live(self) -> bool:
        """Its clock is the wall clock (False: a replay's virtual clock)."""

    @property
    def readonly_reason(self) -> str:
        """Why the engine it watches cannot be steered from here ('' when it can)."""

    @property
    def error(self) -> str | None:
        """Why its reader stopped, if it did."""

    @property
    def engine_keys(self) -> Collection[str]:
        """The keys (``engine/rank``) of the engines it has fed into the state."""

    @property
    def actions(self) -> Sequence[SourceAction]:
        """What its server may be asked to do now (empty: nothing)."""

    @property
    def recording(self) -> bool: ...

    @property
    def recording_path(self) -> str | None: ...

    @property
    def recorded(self) -> int:
        """Messages written to the recording running now (or the last one)."""

    def start(self, state: ConsoleState) -> None:
        """Start feeding ``state`` (its reader thread; a replay at speed 0 feeds it all now)."""

    def stop(self, timeout: float = 2.0) -> None:
        """Stop reading (and recording)."""

    def now(self) -> float:
        """Its clock: wall time live, the recording's time in a replay."""

    def describe(self) -> str:
        """Where it reads from, as the header shows it."""

    def toggle_recording(self, record_dir: Path) -> tuple[str, bool]:
        """Stop the recording, or start one in ``record_dir``: what to tell the operator, and
        False when it could not start."""

    def run_action(self, key: str) -> str:
        """Do one of its ``actions`` (blocking: a worker thread); the answer in a line, or
        `ActionError`."""
