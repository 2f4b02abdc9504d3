"""The bodies of the engine's state topics, built from the engine's plain stats: ``step`` (one
window of steps), ``health``, ``sched`` and ``kv``. Pure functions, one place for every sender:
the publisher, the supervisor's `vconsole.engine.publish.beacon.HealthBeacon`, a data-parallel front
end's telemetry proxy, the benchmarks and the tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from vconsole.engine.publish.mfu import ModelDims
from vconsole.shared.procs import host_identity, process_start
from vconsole.shared.stats import KVStats, RequestTable, SchedulerStats, StepStats
from vconsole.telemetry import schema

_ROW_GETTERS = {c: attrgetter(c) for c in schema.REQUEST_COLUMNS}


def request_columns(rows: Any) -> RequestTable | dict[str, list[Any]]:
    """The ``requests`` table to encode: a `RequestTable` (the scheduler's: numpy columns that
    `schema.encode` sends as raw buffers) goes as it is; RequestRow objects become column
    lists, without per-row dicts."""
    if isinstance(rows, RequestTable):
        return rows
    return {c: list(map(g, rows)) for c, g in _ROW_GETTERS.items()}


def aggregate_steps(steps: list[StepStats], window_s: float) -> dict[str, Any]:
    """The ``step`` topic body for one window of steps (empty window -> zeros)."""
    n = len(steps)
    sched_ns = sum(s.schedule_ns for s in steps)
    totals = np.fromiter((s.total_ns for s in steps), dtype=np.int64, count=n)
    total_ns = int(totals.sum()) if n else 0
    prefill = sum(s.num_prefill_tokens for s in steps)
    decode = sum(s.num_decode_tokens for s in steps)
    per_s = 1.0 / window_s if window_s > 0 else 0.0
    return {
        "steps": n,
        "window_s": window_s,
        "phase_s": {"schedule": sched_ns / 1e9,
                    "execute": sum(s.execute_ns for s in steps) / 1e9,
                    "update": sum(s.update_ns for s in steps) / 1e9,
                    # structured output: bitmask filled and applied, matchers advanced
                    "structured": sum(s.structured_ns for s in steps) / 1e9},
        "busy_s": total_ns / 1e9,
        "step_time_p50_s": float(np.median(totals)) / 1e9 if n else 0.0,
        "step_time_max_s": int(totals.max()) / 1e9 if n else 0.0,
        "num_prefill_tokens": prefill,
        "num_decode_tokens": decode,
        "num_reqs_max": max((s.num_reqs for s in steps), default=0),
        "num_preempted": sum(s.num_preempted for s in steps),
        "num_finished": sum(s.num_finished for s in steps),
        "tokens_per_s": (prefill + decode) * per_s,
        "steps_per_s": n * per_s,
        "sched_share": sched_ns / total_ns if total_ns else 0.0,
    }


def health_body(state: str, *, uptime_s: float, steps: int, interval_s: float,
                started_ts: float, pid: int | None = None, send_drops: int = 0,
                steps_dropped: int = 0, alerts_active: dict[str, str] | None = None,
                last_step_age_s: float | None = None, restart_count: int = 0,
                restart_reason: str | None = None,
                telemetry_errors: int = 0) -> dict[str, Any]:
    """The ``health`` topic body: one place, so the engine's publisher and the supervisor's
    `vconsole.engine.publish.beacon.HealthBeacon` send the same fields. ``restart_count`` and
    ``restart_reason``: how often the supervisor restarted this engine and why it did the last
    time (0 and None: never restarted, or not supervised). ``telemetry_errors``: telemetry
    failures this engine process survived (`vconsole.engine.telemetry_guard`, and this
    publisher's own loop). ``host`` and ``pid_start`` name the process ``pid`` for good (the
    machine and boot, the process's start): a reader of its stacks checks them
    (`vconsole.shared.stacks.check_identity`); read here, so a publisher running in a child
    process of the engine (same machine) reports the engine's."""
    pid = os.getpid() if pid is None else pid
    return {
        "state": state, "uptime_s": uptime_s, "steps": steps, "interval_s": interval_s,
        "pid": pid, "host": dict(host_identity()), "pid_start": process_start(pid),
        "started_ts": started_ts,
        "send_drops": send_drops, "steps_dropped": steps_dropped,
        "alerts_active": {} if alerts_active is None else alerts_active,
        "last_step_age_s": last_step_age_s,
        "restart_count": restart_count, "restart_reason": restart_reason,
        "telemetry_errors": telemetry_errors,
    }


def sched_body(s: SchedulerStats, max_rows: int) -> dict[str, Any]:
    rows = s.requests
    truncated = s.requests_truncated or len(rows) > max_rows
    return {
        "num_waiting": s.num_waiting, "num_running": s.num_running,
        "num_preempted": s.num_preempted, "num_preemptions_total": s.num_preemptions_total,
        "num_finished_total": s.num_finished_total,
        "num_prompt_tokens_total": s.num_prompt_tokens_total,
        "num_generation_tokens_total": s.num_generation_tokens_total,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens, "policy": s.policy,
        "requests": request_columns(rows[:max_rows] if len(rows) > max_rows else rows),
        "requests_truncated": truncated,
        # Structured outputs: requests whose grammar compiles now; since start, compiles,
        # cache hits, failed compiles and compile seconds (`SchedulerStats`).
        "num_compiling": s.num_compiling,
        "structured_compiles_total": s.structured_compiles_total,
        "structured_compile_cache_hits_total": s.structured_compile_cache_hits_total,
        "structured_compile_errors_total": s.structured_compile_errors_total,
        "structured_compile_seconds_total": s.structured_compile_seconds_total,
        # Speculative decoding, when configured (`SchedulerStats.spec_decode`): vLLM's
        # spec-decode counters since start, whether the hot key has it on, drafts per step.
        "spec_decode": s.spec_decode,
    }


@dataclass(frozen=True)
class KVFormat:
    """How the engine's KV pool stores one token, fixed for the engine's life (the dtype and
    the pool are restart-only): ``cache_dtype`` is the stored format (``float32`` /
    ``bfloat16`` for ``kv_cache_dtype=auto``, else the quantized format's canonical name) and
    ``bytes_per_token`` is K and V of one token over every layer, scales included;
    ``pool_bytes`` what the pool takes in all (a per-channel format's staging of the blocks
    still filling included), when the core says; ``staging_bytes`` that staging alone, for
    ``staging_blocks`` open blocks at once (0 for the other formats). ``dims``: the model's
    shape and byte sizes, for the MFU counters (`vconsole.engine.publish.mfu`; None when the
    core does not say)."""

    cache_dtype: str
    bytes_per_token: int
    pool_bytes: int | None = None
    dims: ModelDims | None = None
    staging_bytes: int | None = None
    staging_blocks: int | None = None

    @classmethod
    def of(cls, model_info: dict[str, Any]) -> KVFormat | None:
        """From `EngineCore.model_info` (None when the core does not say: a stand-in core)."""
        dtype, per_token = model_info.get("kv_cache_dtype"), model_info.get("kv_bytes_per_token")
        if not isinstance(dtype, str) or not isinstance(per_token, int):
            return None
        pool = model_info.get("kv_pool_bytes")
        staging, entries = (model_info.get(f"kv_staging_{n}") for n in ("bytes", "blocks"))
        return cls(dtype, per_token, pool if isinstance(pool, int) else None,
                   ModelDims.of(model_info), staging if isinstance(staging, int) else None,
                   entries if isinstance(entries, int) else None)


def kv_body(k: KVStats, kv_format: KVFormat | None = None) -> dict[str, Any]:
    """The ``kv`` body. ``capacity_tokens`` is always the pool's token slots; ``cache_dtype``,
    ``bytes_per_token``, ``pool_bytes``, ``staging_bytes`` and ``staging_blocks`` are None when
    the format is not known;
    ``block_age_s`` (float32 per block, seconds since last allocated or hit, NaN never) is
    there only with --kv-cache-metrics, with ``block_age_ts``, the wall time they were taken
    (an idle engine resends its last snapshot)."""
    capacity = k.num_blocks * k.block_size
    per_token = kv_format.bytes_per_token if kv_format is not None else None
    pool = None
    if kv_format is not None:
        pool = kv_format.pool_bytes if kv_format.pool_bytes is not None \
            else capacity * kv_format.bytes_per_token
    body: dict[str, Any] = {
        "cache_dtype": kv_format.cache_dtype if kv_format is not None else None,
        "bytes_per_token": per_token, "capacity_tokens": capacity, "pool_bytes": pool,
        "staging_bytes": kv_format.staging_bytes if kv_format is not None else None,
        "staging_blocks": kv_format.staging_blocks if kv_format is not None else None,
        "num_blocks": k.num_blocks, "block_size": k.block_size, "num_free": k.num_free,
        "num_used": k.num_used, "num_cached": k.num_cached, "num_shared": k.num_shared,
        "usage": k.usage, "token_usage": k.token_usage, "fragmentation": k.fragmentation,
        "prefix_queries": k.prefix_queries, "prefix_hits": k.prefix_hits,
        "prefix_hit_rate": k.prefix_hit_rate,
        "block_states": np.asarray(k.block_states, dtype=np.uint8),
    }
    if k.block_age_s is not None:
        body["block_age_s"] = np.asarray(k.block_age_s, dtype=np.float32)
        body["block_age_ts"] = k.block_age_ts
    return body
