"""`bench kv-ideas`'s KV dtypes at equal memory: the demo's workload on the real engine for each
KV cache dtype, the first (``auto``, the demo's 64 float32 blocks of 16 tokens) setting the
byte budget the others get; the auto run is also the trace the other experiments replay and
census."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.tools.bench.kv_ideas_runs import load_text, run_engine
from vconsole.tools.bench.kv_ideas_workload import (
    DEMO_BLOCK_SIZE,
    DEMO_BLOCKS,
    DEMO_ENGINE,
    Arrival,
    Traced,
)


@dataclass
class DtypeRuns:
    """Each dtype's row (its pool and run summary, or its error), the byte budget, and what
    the first run leaves for the other experiments: its trace and its engine."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: int | None = None
    trace: list[Traced] = field(default_factory=list)
    auto_core: Any = None
    bytes_per_token: dict[str, int] = field(default_factory=dict)


def dtype_runs(arrivals: Sequence[Arrival], model: str, dtypes: Sequence[str],
               say: Callable[[str], None]) -> DtypeRuns:
    """The arrivals on the real engine once per dtype: the first with `DEMO_BLOCKS` blocks,
    the rest with ``kv_cache_memory_bytes`` = the first's pool. A dtype the engine cannot run
    yet is a row with its error."""
    runs = DtypeRuns()
    for dtype in dtypes:
        cfg: dict[str, Any] = {**DEMO_ENGINE, "block_size": DEMO_BLOCK_SIZE,
                               "kv_cache_dtype": dtype}
        if runs.memory is None:
            cfg["num_kv_blocks"] = DEMO_BLOCKS
        else:
            cfg["kv_cache_memory_bytes"] = runs.memory
        say(f"real engine, kv_cache_dtype {dtype} (load {load_text()}) ...")
        try:
            stats, pool, core = run_engine(arrivals, model=model, **cfg)
        except Exception as e:          # a dtype the engine cannot run yet: say so
            runs.rows[dtype] = {"error": f"{type(e).__name__}: {e}"}
            say(f"  {dtype}: {runs.rows[dtype]['error']}")
            continue
        runs.bytes_per_token[dtype] = pool["kv_bytes_per_token"]
        if runs.memory is None:
            runs.memory = DEMO_BLOCKS * DEMO_BLOCK_SIZE * pool["kv_bytes_per_token"]
            runs.trace = stats.traced
            runs.auto_core = core
        del core
        row = {**pool, **stats.summary(), "load_after": load_text()}
        runs.rows[dtype] = row
        say(f"  {dtype}: {row['num_blocks']} blocks, {row['preemptions']} preemptions, "
            f"{row['output_tok_s']} tok/s, load {row['load_after']}")
    return runs


def dtypes_section(runs: DtypeRuns) -> dict[str, Any]:
    """Experiment 3's figures, judged against its goal: int8 at most half the preemptions of
    auto at equal memory."""
    auto, int8 = runs.rows.get("auto", {}), runs.rows.get("int8", {})
    return {
        "kv_cache_memory_bytes": runs.memory, "runs": runs.rows,
        "goal": "int8 at most half the preemptions of auto at equal memory",
        # None when it cannot tell: a run failed, or auto never preempted (too light a
        # workload: raise --num-requests)
        "int8_half_the_preemptions": (int8["preemptions"] <= auto["preemptions"] / 2)
        if int8.get("preemptions") is not None and auto.get("preemptions") else None}
