"""What the engine process needs of its core, all of it: `vconsole.engine.core.EngineCore` is one.

`EngineCoreProc`, `RequestIntake`, `ProfileBook`, the telemetry feed and the output thread
reach the core only through `ServingCore`, and nothing is probed (no ``hasattr``): a test may
hand the process a smaller fake, and the type checker tells whether it is one (``make test``
runs mypy over this package; `_engine_core_serves` below is checked there, and
``tests/engine/process/test_serving_core_types.py`` shows a fake that lacks a member failing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from vconsole.engine.latency import LatencyBatch
from vconsole.engine.request import Request
from vconsole.engine.telemetry_guard import TelemetryGuard
from vconsole.shared.config import ConfigUpdate, EngineConfig
from vconsole.shared.kv_events import KVEvent
from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from vconsole.engine.core import EngineCore
    from vconsole.engine.sched.scheduler import RowSource
    from vconsole.engine.worker.profiler import StepProfiler


class ServingCore(Protocol):
    config: EngineConfig
    config_version: int
    telemetry_guard: TelemetryGuard
    num_steps: int
    last_step: StepStats | None
    last_finished: list[Request]       # the requests the latest step finished (request trace)
    consecutive_step_failures: int
    last_step_error: str | None

    # --- the model, requests and steps (busy loop; make_request also off it: only reads) ---
    def model_info(self) -> dict[str, Any]: ...
    def make_request(self, request_id: str, *, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, sampling: SamplingParams,
                     priority: int = 0, client_id: bytes = b"") -> Request: ...
    def add_request(self, req: Request) -> RequestOutput | None: ...
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    # False when every unfinished request waits for its grammar: the loop may sleep until the
    # ``wake`` given to set_wakeup is called (from a compile thread) or an input comes.
    def has_ready_requests(self) -> bool: ...
    def set_wakeup(self, wake: Callable[[], None]) -> None: ...
    def step(self) -> tuple[dict[bytes, list[RequestOutput]], bool]: ...
    def dummy_step(self) -> None: ...
    # A finished request's text (the output thread; the tokenizer is only read).
    def detokenize(self, token_ids: list[int]) -> str: ...
    def close(self) -> None: ...

    # --- config, figures, profiling (busy loop, between two steps) ---
    def apply_config(self, values: dict[str, Any]) -> ConfigUpdate: ...
    def scheduler_stats(self, max_rows: int, rows: RowSource | None = None) -> SchedulerStats: ...
    def token_lists(self,
                    request_ids: Iterable[str]) -> list[tuple[str, list[int], list[int]]]: ...
    def kv_stats(self) -> KVStats: ...
    def latency_batch(self) -> LatencyBatch: ...
    def enable_kv_events(self) -> None: ...
    def take_kv_events(self) -> list[KVEvent]: ...
    def enable_kv_residency(self, sample_rate: float) -> None: ...
    def take_kv_residency(self) -> list[ResidencySample]: ...
    def start_profile(self, num_steps: int,
                      on_done: Callable[[], None] | None = None) -> StepProfiler: ...


if TYPE_CHECKING:
    def _engine_core_serves(core: EngineCore) -> ServingCore:
        """Checked by mypy only: the real core satisfies the Protocol."""
        return core
