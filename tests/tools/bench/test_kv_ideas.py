"""`vconsole bench kv-ideas`'s pure parts: the block census, internal fragmentation, the
trace replay through the real scheduler, and the K/V delta measure on `tiny`."""

from __future__ import annotations

import torch

from vconsole.tools.bench.kv_ideas_blocks import (
    geometric_blocks,
    geometric_fragmentation,
    internal_fragmentation,
)
from vconsole.tools.bench.kv_ideas_census import block_census
from vconsole.tools.bench.kv_ideas_deltas import KVProbe, delta_bits, kv_deltas
from vconsole.tools.bench.kv_ideas_runs import replay
from vconsole.tools.bench.kv_ideas_workload import Traced

B = 4


def test_census_tells_hash_equal_from_same_tokens_under_another_prefix() -> None:
    shared = [1, 2, 3, 4]
    seqs = [shared + [5, 6, 7, 8],
            shared + [5, 6, 7, 8],          # both blocks hash-equal: the prefix cache shares them
            [9, 9, 9, 9] + [5, 6, 7, 8]]    # second block: same tokens, another prefix
    census = block_census(seqs, B)
    assert census.total == 6
    assert census.distinct == 4
    assert [(r.seq, r.index, r.ref_seq, r.ref_index) for r in census.hash_equal] == \
        [(1, 0, 0, 0), (1, 1, 0, 1)]
    assert [(r.seq, r.index, r.ref_seq, r.ref_index) for r in census.same_tokens] == \
        [(2, 1, 0, 1)]
    assert census.near == [] and census.shifted == []


def test_census_counts_near_duplicates_at_the_share_and_not_below() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 99], [1, 2, 98, 99]]
    census = block_census(seqs, B, near_share=0.75)
    # [1,2,3,99] matches [1,2,3,4] at 3 of 4 positions; [1,2,98,99] matches [1,2,3,99] at 3 of 4
    assert [(r.seq, r.ref_seq, r.share) for r in census.near] == [(1, 0, 0.75), (2, 1, 0.75)]
    assert block_census(seqs, B, near_share=0.8).near == []


def test_census_finds_tokens_repeated_off_the_block_grid() -> None:
    seqs = [[7, 1, 2, 3, 4, 7, 7, 7], [1, 2, 3, 4]]
    census = block_census(seqs, B)
    # [1,2,3,4] starts at offset 1 of the first sequence: a shifted copy, not a near duplicate
    assert [(r.seq, r.index, r.ref_seq, r.ref_index) for r in census.shifted] == \
        [(1, 0, 0, 1)]
    assert census.same_tokens == [] and census.near == []


def test_census_ignores_partial_blocks() -> None:
    census = block_census([[1, 2, 3], [1, 2, 3, 4, 5]], B)
    assert census.total == 1 and census.distinct == 1


def test_internal_fragmentation_is_the_empty_tail_of_each_last_block() -> None:
    assert internal_fragmentation([4, 5, 7], 4) == (0 + 3 + 1, 4 + 8 + 8)
    wasted_small, _ = internal_fragmentation(list(range(1, 200)), 8)
    wasted_big, _ = internal_fragmentation(list(range(1, 200)), 64)
    assert wasted_big > 4 * wasted_small


def test_geometric_blocks_grow_by_half_from_64_and_cover_the_request() -> None:
    assert geometric_blocks(1) == [64]
    assert geometric_blocks(64) == [64]
    assert geometric_blocks(65) == [64, 96]
    assert geometric_blocks(305) == [64, 96, 144, 216]
    assert geometric_fragmentation([65, 160]) == (160 - 65 + 0, 160 + 160)


def test_delta_bits_is_zero_for_equal_rows_and_eight_for_a_full_scale_delta() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert delta_bits(x, x.clone()) == 0.0
    assert delta_bits(x, -x) == 8.0
    assert abs(delta_bits(x, x + 2.0 / 16) - 4.0) < 1e-6   # delta max|x| / 16: 4 bits


def _trace(n: int, prompt: int, output: int, gap_s: float) -> list[Traced]:
    return [Traced(f"r{i}", [10 + i] * prompt, [3 + i % 5] * output, 0, i * gap_s)
            for i in range(n)]


def test_replay_reproduces_the_traced_outputs_and_counts_preemptions() -> None:
    trace = _trace(8, prompt=30, output=40, gap_s=0.0)     # all at once into a small pool
    stats = replay(trace, block_size=8, num_blocks=24, max_num_seqs=8,
                   max_num_batched_tokens=64)
    assert [t.output for t in stats.traced] == [t.output for t in trace]
    assert stats.preemptions > 0
    assert stats.output_tokens == 8 * 40
    roomy = replay(trace, block_size=8, num_blocks=400, max_num_seqs=8,
                   max_num_batched_tokens=64)
    assert roomy.preemptions == 0


def test_replay_fragmentation_grows_with_the_block_size() -> None:
    trace = _trace(6, prompt=21, output=10, gap_s=1.0)
    small = replay(trace, block_size=8, num_blocks=128).summary()
    big = replay(trace, block_size=64, num_blocks=16).summary()
    assert 0 < small["fragmentation"] < big["fragmentation"] < 1
    assert small["prefix_hit_rate"] == big["prefix_hit_rate"] == 0.0


def test_kv_deltas_on_tiny_equal_tokens_under_another_prefix_differ_but_not_at_layer_0() -> None:
    from vconsole.engine.worker.model_loader import load_model
    from vconsole.tools.bench.kv_ideas_census import BlockRef

    model, _, _ = load_model("tiny", "cpu", "float32")
    model.set_attn_implementation("sdpa")
    seqs = [[5, 6, 7, 8, 20, 21, 22, 23], [9, 9, 9, 9, 20, 21, 22, 23]]
    out = kv_deltas(KVProbe(model), seqs, [BlockRef(1, 1, 0, 1)], B)
    assert out["pairs"] == 1
    assert out["k_pre_rel_diff_by_layer"]["0"] == 0.0      # layer 0 K is the token's alone
    assert out["v_rel_diff"] > 0.0                         # later layers see the other prefix
    assert out["k_rope_rel_diff"] > 0.0
