"""The busy loop's role: a lone engine, or one rank of a data-parallel group.

`EngineCoreProc` talks to its role through `ProcessRole` only, so the loop has no "if data
parallel" branches: a lone engine's role (`LoneEngine`) does nothing at each hook; a rank's
(`vconsole.engine.dp.rank.role.DPRank`) starts and completes waves, runs dummy steps inside
one, regroups when the front end says so and publishes the ``dp`` topic — as vLLM's
``DPEngineCoreProc`` does beside its ``EngineCoreProc``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vconsole.engine.dp.rank.role import WaveEvent


class ProcessRole(Protocol):
    is_rank: bool    # a rank takes ``regroup`` / ``start_wave`` and adds its key to ``ready``
    device: Any      # the model's device, set once the core exists

    @property
    def in_wave(self) -> bool:
        """A wave runs: the loop must step (real or dummy) instead of waiting for input."""

    def maybe_start(self, has_work: bool) -> WaveEvent | None:
        """Before a step: a wave this process starts."""

    def after_step(self, dummy: bool, busy: bool) -> WaveEvent | None:
        """After a step (``dummy``: one without requests): a wave that completed."""

    def on_front_end(self, kind: str, value: int,
                     submit_dp: Callable[[dict[str, Any]], None]) -> WaveEvent | None:
        """The front end's ``regroup`` or ``start_wave``, between two steps."""

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

    def __init__(self) -> None:
        self.device: Any = "cpu"

    def maybe_start(self, has_work: bool) -> None:
        return None

    def after_step(self, dummy: bool, busy: bool) -> None:
        return None

    def on_front_end(self, kind: str, value: int,
                     submit_dp: Callable[[dict[str, Any]], None]) -> None:
        raise AssertionError("the input thread refuses regroup/start_wave on a lone engine")

    def dp_body(self) -> None:
        return None

    def publish_ready(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
