"""`bench kv-ideas`'s block sizes ("grow block sizes from 64 tokens by 1.5x"): the real run's
trace replayed at block sizes 8..128 with the same pool memory in tokens, beside the internal
fragmentation of fixed and geometrically growing blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vconsole.tools.bench.kv_ideas_runs import replay
from vconsole.tools.bench.kv_ideas_workload import DEMO_BLOCK_SIZE, DEMO_BLOCKS, Traced


def internal_fragmentation(lengths: Sequence[int], block_size: int) -> tuple[int, int]:
    """(wasted slots, allocated slots) of sequences of these lengths in blocks of this size:
    each wastes the empty tail of its last block."""
    allocated = sum(-(-n // block_size) * block_size for n in lengths)
    return allocated - sum(lengths), allocated


def geometric_blocks(length: int, first: int = 64, growth: float = 1.5) -> list[int]:
    """The write-up's "grow block sizes from 64 tokens by 1.5x" for one request: its blocks are
    64, 96, 144, 216, ... tokens (each 1.5x the last, rounded), as many as cover ``length``."""
    sizes: list[int] = []
    size = float(first)
    while sum(sizes) < length:
        sizes.append(round(size))
        size *= growth
    return sizes


def geometric_fragmentation(lengths: Sequence[int], first: int = 64,
                            growth: float = 1.5) -> tuple[int, int]:
    """(wasted slots, allocated slots) of `geometric_blocks` for sequences of these lengths."""
    allocated = sum(sum(geometric_blocks(n, first, growth)) for n in lengths)
    return allocated - sum(lengths), allocated


def block_sizes_section(trace: Sequence[Traced], block_sizes: Sequence[int],
                        real: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """Experiment 2: ``trace`` replayed at each block size with the demo pool's tokens;
    ``real`` is the auto run's summary (its preemptions are what the replay at the demo's
    block size must reproduce)."""
    pool_tokens = DEMO_BLOCKS * DEMO_BLOCK_SIZE
    lengths = [len(t.prompt) + len(t.output) - 1 for t in trace]
    rows = {}
    for B in block_sizes:
        stats = replay(trace, B, pool_tokens // B)
        rows[str(B)] = {"num_blocks": pool_tokens // B, **stats.summary()}
        for k in ("engine_s", "output_tok_s", "virtual_s"):
            rows[str(B)].pop(k)
        rows[str(B)]["virtual_s"] = round(stats.virtual_s, 1)
        wasted, allocated = internal_fragmentation(lengths, B)
        rows[str(B)]["whole_request_waste"] = round(wasted / allocated, 4)
        say(f"  block size {B}: {rows[str(B)]}")
    wasted, allocated = geometric_fragmentation(lengths)
    fixed_wasted, fixed_allocated = internal_fragmentation(lengths, DEMO_BLOCK_SIZE)
    return {
        "pool_tokens": pool_tokens,
        "method": "the auto run's trace replayed through the real Scheduler and KV manager "
                  "with the model replaced by the trace (same tokens, same arrivals)",
        "replay_matches_real": rows.get(str(DEMO_BLOCK_SIZE), {}).get("preemptions")
        == real.get("preemptions") if real else None,
        "runs": rows,
        "grow_1_5x_from_64": {
            "meaning": "a request's blocks are 64, 96, 144, 216 ... tokens (or one pool-wide "
                       "size stepped 64 -> 96 -> 144: the runs above)",
            "whole_request_waste": round(wasted / allocated, 4) if allocated else 0.0,
            "whole_request_waste_fixed_16": round(fixed_wasted / max(fixed_allocated, 1), 4)}}
