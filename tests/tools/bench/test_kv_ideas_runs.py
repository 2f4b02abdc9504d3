"""`bench kv-ideas`'s runs on the what-if's virtual-clock loop (`run_on_virtual_clock`): the
replay gives, to the step, the figures kv-ideas' own copy of the loop gave before it was
dropped, and a last arrival no pool can hold ends the run as a refusal."""

from __future__ import annotations

import pytest

from vconsole.tools.bench.kv_ideas_runs import replay
from vconsole.tools.bench.kv_ideas_workload import Traced


def _trace() -> list[Traced]:
    """12 requests, prompts of 9..53 tokens, outputs of 5..38, three priorities, in bursts of
    four a quarter second apart."""
    return [Traced(f"r{i}", [(7 * i + j) % 50 + 3 for j in range(9 + (i * 17) % 45)],
                   [(3 * i + j) % 40 + 3 for j in range(5 + (i * 11) % 34)], i % 3,
                   0.25 * (i // 4)) for i in range(12)]


def test_replay_on_the_what_if_loop_gives_the_figures_of_the_loop_it_replaced() -> None:
    # Captured from kv-ideas' own loop (`_drive` before it ran on `run_on_virtual_clock`).
    stats = replay(_trace(), block_size=8, num_blocks=16, max_num_seqs=6,
                   max_num_batched_tokens=48)
    summary = stats.summary()
    for wall in ("engine_s", "output_tok_s"):
        summary.pop(wall)
    assert summary == {"steps": 121, "preemptions": 11, "output_tokens": 276, "rejected": 0,
                       "virtual_s": 11.2, "prefix_hit_rate": 0.0, "fragmentation": 0.0828,
                       "wasted_slots_mean": 7.9, "wasted_share_of_pool": 0.0619}
    assert stats.virtual_s == pytest.approx(11.234)
    assert [t.rid for t in stats.traced] == [f"r{i}" for i in range(12)]
    assert [t.num_preemptions for t in stats.traced] == [0, 1, 2, 0, 2, 2, 0, 0, 1, 1, 1, 1]
    assert [t.output for t in stats.traced] == [t.output for t in _trace()]


def test_a_last_arrival_too_long_for_the_pool_is_refused_and_ends_the_run() -> None:
    trace = _trace()[:3] + [Traced("big", [5] * 300, [6] * 4, 0, 5.0)]   # 16 blocks of 8: 128
    stats = replay(trace, block_size=8, num_blocks=16)
    assert stats.rejected == 1
    assert [t.rid for t in stats.traced] == ["r0", "r1", "r2"]
    assert stats.output_tokens == sum(len(t.output) for t in trace[:3])
    assert stats.virtual_s == 5.0          # the clock stopped at the refused arrival
