"""BlockPool: the free list is an LRU over freed blocks, ref counts and states stay consistent."""

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vconsole.engine.kv.block_pool import BlockPool, hash_block_tokens
from vconsole.shared.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED


def counts(pool: BlockPool) -> dict[int, int]:
    values, n = np.unique(pool.block_states, return_counts=True)
    return dict(zip(values.tolist(), n.tolist(), strict=True))


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(5, 4)
    assert pool.free_list() == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0
    assert counts(pool) == {BLOCK_FREE: 5}
    pool.check_invariants()


def test_allocate_pops_head_and_free_appends_tail():
    pool = BlockPool(4, 4)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.block_states.tolist() == [BLOCK_USED, BLOCK_USED, BLOCK_FREE, BLOCK_FREE]
    pool.free_blocks([1, 0])
    assert pool.free_list() == [2, 3, 1, 0]
    assert pool.get_new_blocks(3) == [2, 3, 1]
    pool.check_invariants()


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3, 4)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(2, 4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_touch_shares_a_used_block_and_free_unshares_it():
    pool = BlockPool(3, 4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    assert pool.block_states[b] == BLOCK_SHARED and pool.num_shared_blocks == 1
    pool.free_blocks([b])
    assert pool.block_states[b] == BLOCK_USED and pool.num_shared_blocks == 0
    pool.free_blocks([b])
    assert pool.block_states[b] == BLOCK_FREE
    pool.check_invariants()


def test_freed_cached_block_is_reusable_until_evicted_in_lru_order():
    pool = BlockPool(4, 2)
    blocks = pool.get_new_blocks(4)
    hashes = {b: hash_block_tokens(None, [b, b]) for b in blocks}
    for b in blocks:
        pool.set_fill(b, 2)
        assert pool.cache_full_block(b, hashes[b])
    pool.free_blocks([2, 0, 3, 1])  # LRU order, oldest first
    assert pool.num_cached_blocks == 4 and counts(pool) == {BLOCK_CACHED: 4}
    assert pool.free_list() == [2, 0, 3, 1]

    # A prefix hit revives block 3 from the middle of the free list.
    assert pool.get_cached_block(hashes[3]) == 3
    pool.touch([3])
    assert pool.free_list() == [2, 0, 1]
    assert pool.block_states[3] == BLOCK_USED and pool.tokens_stored == 2

    # Allocation evicts the least recently freed first and forgets its hash.
    assert pool.get_new_blocks(1) == [2]
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) == 0
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_a_prefix_is_registered_once_first_block_wins():
    pool = BlockPool(4, 2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_full_block(a, h)
    assert not pool.cache_full_block(b, h)
    assert not pool.cache_full_block(a, hash_block_tokens(None, [3, 4]))
    assert pool.get_cached_block(h) == a and pool.block_hash(b) is None
    pool.free_blocks([a, b])
    assert pool.block_states[a] == BLOCK_CACHED and pool.block_states[b] == BLOCK_FREE
    pool.check_invariants()


def test_reset_prefix_cache_turns_cached_blocks_into_free_ones():
    pool = BlockPool(3, 2)
    a, b = pool.get_new_blocks(2)
    for i, blk in enumerate((a, b)):
        pool.set_fill(blk, 2)
        pool.cache_full_block(blk, hash_block_tokens(None, [i, i]))
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.block_states[a] == BLOCK_FREE
    assert pool.block_hash(b) is None and pool.block_states[b] == BLOCK_USED
    pool.free_blocks([b])
    assert counts(pool) == {BLOCK_FREE: 3}
    pool.check_invariants()


def test_block_hash_chains_the_prefix_and_is_stable_across_processes():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(h1, [4, 5, 6]) == hash_block_tokens(h1, (4, 5, 6))
    code = ("from vconsole.engine.kv.block_pool import hash_block_tokens as h;"
            "print(h(h(None, [1, 2, 3]), [4, 5, 6]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "random"},
                           cwd=Path(__file__).resolve().parents[3]).stdout
    assert int(other) == hash_block_tokens(h1, [4, 5, 6])


def test_randomized_operations_keep_every_invariant():
    rng = random.Random(1234)
    B = 4
    pool = BlockPool(32, B)
    owners: list[list[int]] = []   # each owner holds one reference on each of its blocks
    registered: dict[int, int] = {}  # hash -> block, as we registered them
    next_hash = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            k = rng.randint(1, 4)
            if k <= pool.num_free_blocks:
                before = set(pool.free_list()[:k])
                got = pool.get_new_blocks(k)
                assert set(got) == before
                for b in got:  # evicted hashes are gone
                    registered = {h: x for h, x in registered.items() if x != b}
                owners.append(got)
        elif op < 0.6 and owners:
            held = owners.pop(rng.randrange(len(owners)))
            pool.free_blocks(reversed(held))
        elif op < 0.8 and owners:
            held = rng.choice(owners)
            b = rng.choice(held)
            pool.set_fill(b, B)
            next_hash += 1
            if pool.cache_full_block(b, next_hash):
                registered[next_hash] = b
        elif registered:
            h = rng.choice(list(registered))
            b = pool.get_cached_block(h)
            assert b == registered[h]
            pool.touch([b])
            owners.append([b])
        pool.check_invariants()
        refs = {}
        for held in owners:
            for b in held:
                refs[b] = refs.get(b, 0) + 1
        free = set(pool.free_list())
        assert not free & set(refs), "a block is both free and used"
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == refs.get(b, 0)
        c = counts(pool)
        assert c.get(BLOCK_FREE, 0) + c.get(BLOCK_CACHED, 0) == pool.num_free_blocks
        assert c.get(BLOCK_CACHED, 0) == pool.num_cached_blocks
        assert c.get(BLOCK_SHARED, 0) == pool.num_shared_blocks
    for held in owners:
        pool.free_blocks(held)
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    assert pool.num_used_blocks == 0 and pool.tokens_stored == 0
    pool.check_invariants()


def test_state_snapshot_is_cheap_at_a_million_blocks():
    pool = BlockPool(1 << 20, 16)
    pool.get_new_blocks(1000)
    states = pool.block_states
    # Cheap by its form, not by a stopwatch: one contiguous byte per block, copied as memory
    # (no Python object per block to build or walk).
    assert isinstance(states, np.ndarray) and states.flags.c_contiguous
    snap = states.copy()
    assert snap.dtype == np.uint8 and snap.shape == (1 << 20,) and snap.nbytes == 1 << 20
    assert int((snap == BLOCK_USED).sum()) == 1000
