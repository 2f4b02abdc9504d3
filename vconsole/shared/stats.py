"""Figures the engine computes about itself, as plain data the telemetry layer publishes.

The engine fills these between steps; it never formats or sends them. `vconsole.engine.publish.publisher` turns
them into wire messages (see `vconsole.telemetry.schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import numpy as np

# Per-block states in KVStats.block_states (uint8), the same codes on the wire.
BLOCK_FREE = 0
BLOCK_USED = 1
BLOCK_CACHED = 2   # free, but holds a cached prefix block that can be reused until evicted
BLOCK_SHARED = 3   # used by more than one request

# A sampled KV block's eviction (--kv-cache-metrics, `vconsole.engine.kv.residency`): its
# lifetime, idle time before eviction and the gaps between its last accesses, in seconds; and
# vLLM's bounds for the three histograms (``kv_cache_residency_buckets`` in its loggers.py).
ResidencySample = tuple[float, float, tuple[float, ...]]
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                     20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)


@dataclass(slots=True)
class StepStats:
    """One `EngineCore.step()`: phase durations (monotonic ns) and batch composition.

    The fields from ``start_ns`` on are the request trace's step features
    (`vconsole.engine.process.request_trace`, what a step-time model is fitted on); the
    ``step`` telemetry topic aggregates only the fields above them, so they stay off the
    wire. ``num_context_tokens``: positions the scheduled rows attend to (start + n each);
    ``prefill_attention``: n x (start + n) over prefill chunks; ``num_new_reqs``: requests
    sent whole to the runner (new or resumed); ``num_running`` / ``num_waiting`` /
    ``kv_used_blocks``: after the step (blocks referenced by at least one request).

    ``structured_ns`` (last, so positional construction stays as it was) is a fourth phase:
    structured output's work in the step (the next-token bitmask of the constrained rows
    filled, applied to their logits, the matchers advanced with the sampled tokens); 0 when no
    row is constrained. ``schedule_ns + execute_ns + structured_ns + update_ns == total_ns``
    (the bitmask's application, inside the model runner, is moved from execute to it).

    ``num_prefill_reqs`` / ``prefill_context_tokens``: the prefill chunks (rows with n > 1,
    vLLM's ``is_prefill``) and the sum of their start + n; with ``num_context_tokens`` and
    ``prefill_attention`` they are vLLM's per-step ``ExecutionContext`` (the MFU counters,
    `vconsole.engine.publish.mfu`). ``native``: the step's forward was one native call
    (`vconsole.engine.worker.native_decode`), the request trace's step regime."""

    schedule_ns: int
    execute_ns: int
    update_ns: int
    total_ns: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_reqs: int
    num_preempted: int = 0
    num_finished: int = 0
    start_ns: int = 0                 # time.monotonic_ns() when the step began
    num_context_tokens: int = 0
    prefill_attention: int = 0
    num_new_reqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    structured_ns: int = 0
    num_prefill_reqs: int = 0
    prefill_context_tokens: int = 0
    native: bool = False              # the forward ran as one native call (`native_decode`)


@dataclass
class RequestRow:
    id: str
    state: str           # waiting / running / preempted / compiling
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int
    age_s: float
    constraint: int = 0      # 0 none, else 1 + the index in CONSTRAINT_KINDS
    compile_ms: float = 0.0  # its grammar's compile (or cache) time; 0 until compiled


# A request's state as a small code (uint8 on the wire): the index here, which is also
# `vconsole.engine.request.RequestStatus`'s value (tests/telemetry/test_request_columns.py
# checks it).
# A row is never "finished"; "compiling": its structured-output grammar is being compiled.
REQUEST_STATES = ("waiting", "running", "preempted", "finished", "compiling")
# A request's structured-output constraint as the ``constraint`` column's code: 0 none, else
# 1 + the index here (`vconsole.wire.sampling.STRUCTURED_KINDS`, the same names: checked by
# tests/engine/structured/test_spec.py).
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The numeric columns of a `RequestTable` and their dtypes (those of the ``sched`` wire form).
REQUEST_NUMERIC = {"priority": np.int32, "num_prompt_tokens": np.int32,
                   "num_output_tokens": np.int32, "num_blocks": np.int32, "age_s": np.float64,
                   "constraint": np.uint8, "compile_ms": np.float32}


class TableParts(Protocol):
    """Where a `RequestTable` built on demand gets its columns (the cached waiting rows
    behind fresh running rows: `vconsole.engine.publish.request_rows.JoinedRows`)."""

    def __len__(self) -> int: ...
    def columns(self) -> dict[str, Any]: ...


class RequestTable(Sequence[RequestRow]):
    """Request rows kept by column, as the ``sched`` topic sends them: ten thousand rows are
    a list of ids and six numpy arrays, not ten thousand objects, and the publisher sends the
    arrays as raw buffers without touching a row. ``columns``: ``id`` a list of str, ``state``
    uint8 codes (`REQUEST_STATES`), the `REQUEST_NUMERIC` columns arrays of those dtypes, all
    equally long. Reads as a sequence of `RequestRow` (built on access, Python values).

    ``parts`` instead of ``columns``: the columns are built from them at first use (`parts`
    stays readable until then, so a hand-off can send the parts rather than the rows)."""

    __slots__ = ("_columns", "parts")

    def __init__(self, columns: dict[str, Any] | None = None,
                 parts: TableParts | None = None) -> None:
        if (columns is None) == (parts is None):
            raise ValueError("a RequestTable has columns or parts")
        self._columns = columns
        self.parts = parts

    @property
    def columns(self) -> dict[str, Any]:
        if self._columns is None:
            assert self.parts is not None
            self._columns, self.parts = self.parts.columns(), None
        return self._columns

    @columns.setter
    def columns(self, value: dict[str, Any]) -> None:
        self._columns, self.parts = value, None

    def __len__(self) -> int:
        if self._columns is None:
            assert self.parts is not None
            return len(self.parts)
        return len(self._columns["id"])

    @overload
    def __getitem__(self, i: int) -> RequestRow: ...
    @overload
    def __getitem__(self, i: slice) -> RequestTable: ...
    def __getitem__(self, i: int | slice) -> RequestRow | RequestTable:
        if isinstance(i, slice):
            return RequestTable({c: v[i] for c, v in self.columns.items()})
        c = self.columns
        return RequestRow(c["id"][i], REQUEST_STATES[int(c["state"][i])],
                          *(c[k][i].item() for k in REQUEST_NUMERIC if k in c))


@dataclass
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_preempted: int          # currently waiting after a preemption
    num_preemptions_total: int  # since start
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    num_finished_total: int = 0
    # Cumulative since start, counted as vLLM counts ``vllm:prompt_tokens`` and
    # ``vllm:generation_tokens`` (see `Scheduler.update_from_output`).
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    requests: Sequence[RequestRow] = field(default_factory=list)  # list or RequestTable
    requests_truncated: bool = False
    # Structured outputs: requests whose grammar compiles now (not yet schedulable), and
    # since start: grammars compiled, requests served from the compile cache, compiles that
    # failed (their requests finished with ``error``), seconds spent compiling (on the
    # engine's compile thread, off the busy loop).
    num_compiling: int = 0
    structured_compiles_total: int = 0
    structured_compile_cache_hits_total: int = 0
    structured_compile_errors_total: int = 0
    structured_compile_seconds_total: float = 0.0
    # Speculative decoding (None when not configured, so vLLM's spec-decode series appear
    # only where it is): ``enabled`` (not paused by the hot key), ``num_speculative_tokens``,
    # and since start vLLM's counters ``num_drafts``, ``num_draft_tokens``,
    # ``num_accepted_tokens`` and ``accepted_per_pos`` (a list, one per draft position);
    # ``requests``: per running request that drafted, [steps with a draft, drafted tokens,
    # accepted tokens] by id (the Requests screen's columns; at most the rows sent).
    spec_decode: dict[str, Any] | None = None


@dataclass
class KVStats:
    num_blocks: int
    block_size: int
    num_free: int        # free and holding nothing reusable
    num_used: int        # referenced by at least one request
    num_cached: int      # free but holding a reusable prefix block
    num_shared: int      # referenced by more than one request
    usage: float         # used blocks / all blocks
    token_usage: float   # tokens stored / slots in the pool
    fragmentation: float  # 1 - tokens stored / slots of allocated blocks (0 when none allocated)
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int     # of those, tokens found cached
    block_states: np.ndarray  # uint8[num_blocks], codes above
    # --kv-cache-metrics only: float32[num_blocks], seconds since each block was last
    # allocated or hit (NaN: never); None when off (`vconsole.engine.kv.residency`).
    block_age_s: np.ndarray | None = None
    block_age_ts: float = 0.0   # wall time the ages were taken (an idle engine resends them)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
