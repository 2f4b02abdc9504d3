"""The busy loop's role: a lone engine, or one rank of a data-parallel group.

`EngineCoreProc` talks to its role through `ProcessRole` only, so the loop has no "if data
parallel" branches. Whoever starts the process picks the role and passes it in, as vLLM picks
``DPEngineCoreProc`` over ``EngineCoreProc``: `LoneEngine` here (it does nothing at each hook),
or a rank's (`vconsole.engine.dp.rank`: it starts and completes waves, runs dummy steps inside
one, regroups when the front end says so and publishes the ``dp`` and ``wave`` topics). This
package never imports the data-parallel one: the rank builds on the loop, not the other way.

The loop hands its role `LoopLinks` once the core and the publisher exist: all a role may do
to the loop (publish, tell the clients, mark the state changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vconsole.engine.process.loop_inputs import FrontEnd
from vconsole.shared.config import EngineConfig
from vconsole.wire import protocol


@dataclass(frozen=True)
class LoopLinks:
    """What a role may reach of the busy loop (called from the busy loop's thread only)."""

    device: str                                     # the model's device
    submit_wave: Callable[[dict[str, Any]], None]   # the ``wave`` telemetry topic
    submit_dp: Callable[[dict[str, Any]], None]     # the ``dp`` telemetry topic
    send_wave: Callable[[str, int], None]           # a ``wave`` message to every client
    changed: Callable[[], None]                     # state changed: the next snapshot is due


class ProcessRole(Protocol):
    is_rank: bool    # a rank adds its control key to ``ready`` (CURVE)

    @property
    def in_wave(self) -> bool:
        """A wave runs: the loop must step (real or dummy) instead of waiting for input."""

    def join(self, config: EngineConfig) -> EngineConfig:
        """Before anything binds: the config this process runs with (a rank's own values),
        once its group's store is reachable (raises an OSError when not)."""

    def attach(self, links: LoopLinks) -> None:
        """The core and the publisher exist: how to reach the loop from now on."""

    def front_end_input(self, kind: str, header: dict[str, Any]) -> FrontEnd:
        """The input thread read a ``start_wave`` or ``regroup``: the input for the busy loop.
        Raises `protocol.ProtocolError` when this process takes none. Any thread (no state)."""

    def on_front_end(self, kind: str, value: int) -> None:
        """The front end's ``regroup`` or ``start_wave``, between two steps."""

    def before_step(self, has_work: bool) -> None:
        """Before a step (``has_work``: requests wait): a rank may start a wave here."""

    def after_step(self, dummy: bool, busy: bool) -> None:
        """After a step (``dummy``: one without requests; ``busy``: requests remain)."""

    def dp_body(self) -> dict[str, Any] | None:
        """The ``dp`` topic body; None: no such topic."""

    def publish_ready(self, record: dict[str, Any]) -> None:
        """The process serves: tell whoever must find it beyond the ready file."""

    def close(self) -> None:
        """The loop is leaving."""


class LoneEngine:
    """A lone engine's role: no group, no waves, no ``dp`` topic."""

    is_rank = False
    in_wave = False

    def join(self, config: EngineConfig) -> EngineConfig:
        return config

    def attach(self, links: LoopLinks) -> None:
        pass

    def front_end_input(self, kind: str, header: dict[str, Any]) -> FrontEnd:
        raise protocol.ProtocolError(f"{kind}: this engine is not a data-parallel rank "
                                     "(data_parallel_size 1)")

    def on_front_end(self, kind: str, value: int) -> None:
        raise AssertionError("the input thread refuses regroup/start_wave on a lone engine")

    def before_step(self, has_work: bool) -> None:
        pass

    def after_step(self, dummy: bool, busy: bool) -> None:
        pass

    def dp_body(self) -> None:
        return None

    def publish_ready(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
