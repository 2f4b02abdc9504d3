"""Sampled KV block residency (vLLM's --kv-cache-metrics) on a real BlockPool: a block's life
runs from its allocation to the allocation that evicts it; prefix hits are its accesses."""

from __future__ import annotations

import pytest

from vconsole.engine.kv.block_pool import BlockPool
from vconsole.engine.kv.residency import HISTORY, BlockResidency


class Clock:
    """Monotonic ns the test moves by hand."""

    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)


def pool_with(rate: float, num_blocks: int = 4) -> tuple[BlockPool, BlockResidency, Clock]:
    clock = Clock()
    pool = BlockPool(num_blocks, block_size=4)
    pool.residency = BlockResidency(rate, clock=clock)
    return pool, pool.residency, clock


def test_a_block_evicted_by_a_new_allocation_is_one_sample_of_its_life() -> None:
    pool, res, clock = pool_with(1.0, num_blocks=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111)
    clock.advance(2.0)
    pool.free_blocks([a])                 # cached, still alive: no sample
    assert res.take() == []
    clock.advance(1.0)
    pool.touch([a])                       # prefix hit at t=3
    clock.advance(4.0)
    pool.touch([a])                       # second hit at t=7 (shared now)
    clock.advance(0.5)
    pool.free_blocks([a, a])
    clock.advance(10.0)
    assert pool.get_new_blocks(1) == [a]  # t=17.5: evicted by this allocation
    (lifetime, idle, gaps), = res.take()
    assert lifetime == pytest.approx(17.5)
    assert idle == pytest.approx(10.5)
    assert gaps == pytest.approx((4.0,))
    assert res.tracked() == [b, a]        # the new allocation is followed in turn
    pool.check_invariants()


def test_a_block_never_hit_is_idle_for_its_whole_life_with_no_gaps() -> None:
    pool, res, clock = pool_with(1.0, num_blocks=1)
    (a,) = pool.get_new_blocks(1)
    clock.advance(0.25)
    pool.free_blocks([a])
    clock.advance(0.75)
    pool.get_new_blocks(1)
    assert res.take() == [(pytest.approx(1.0), pytest.approx(1.0), ())]


def test_only_the_last_accesses_make_gaps() -> None:
    pool, res, clock = pool_with(1.0, num_blocks=1)
    (a,) = pool.get_new_blocks(1)
    for gap in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        clock.advance(gap)
        pool.touch([a])
    pool.free_blocks([a] * 7)
    pool.get_new_blocks(1)
    (_, _, gaps), = res.take()
    assert len(gaps) == HISTORY - 1
    assert gaps == pytest.approx((4.0, 5.0, 6.0))


def test_every_nth_allocation_is_sampled_across_calls() -> None:
    pool, res, _ = pool_with(0.25, num_blocks=64)
    first = pool.get_new_blocks(3)         # allocations 1..3
    assert res.tracked() == []
    second = pool.get_new_blocks(10)       # allocations 4..13: the 4th, 8th, 12th
    assert res.tracked() == [second[0], second[4], second[8]]
    third = pool.get_new_blocks(4)         # 14..17: the 16th
    assert res.tracked()[-1] == third[2]
    assert len(res.tracked()) == 4
    assert first[0] not in res.tracked()


def test_a_prefix_cache_reset_forgets_the_followed_blocks() -> None:
    pool, res, _ = pool_with(1.0, num_blocks=2)
    a, _ = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7)
    pool.reset_prefix_cache()
    assert res.tracked() == []
    pool.free_blocks([a])
    pool.get_new_blocks(1)
    assert res.take() == []


def test_a_pool_without_residency_records_nothing() -> None:
    pool = BlockPool(4, block_size=4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    pool.touch(blocks[:1])
    assert pool.residency is None


def test_a_sample_rate_outside_0_1_is_refused() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
            BlockResidency(bad)


def test_every_block_is_stamped_when_allocated_or_hit_and_ages_count_from_there() -> None:
    """The KV map's age view: every block, sampled or not, and NaN for one never handed out."""
    clock = Clock()
    pool = BlockPool(4, block_size=4)
    pool.residency = res = BlockResidency(0.01, clock=clock, num_blocks=4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111)
    clock.advance(3.0)
    pool.free_blocks([a, b])
    pool.touch([a])                       # a prefix hit at t=3
    clock.advance(2.0)
    ages = res.ages()
    assert ages[a] == pytest.approx(2.0) and ages[b] == pytest.approx(5.0)
    assert all(age != age for age in ages[2:])   # NaN: never touched
    assert res.tracked() == []            # none sampled: stamping does not depend on it
