"""KVCacheManager: block tables, prefix hits, token accounting and the hot prefix-caching toggle."""

import random

import pytest

from vconsole.engine.kv.kv_cache_manager import KVCacheManager, token_slice
from vconsole.engine.request import Request
from vconsole.shared.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from vconsole.wire.sampling import SamplingParams

B = 4


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit_and_compute(kv: KVCacheManager, req: Request) -> int:
    """Admit like the scheduler does and pretend the model computed the whole prompt."""
    blocks, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - cached, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return cached


def test_token_slice_matches_all_token_ids():
    r = make("a", [1, 2, 3])
    r.output_token_ids = [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert token_slice(r, start, end) == r.all_token_ids[start:end]


def test_two_requests_share_a_three_block_prefix():
    kv = KVCacheManager(16, B)
    prefix = list(range(100, 100 + 3 * B))
    a, b = make("a", prefix + [1, 2]), make("b", prefix + [7, 8, 9])
    assert admit_and_compute(kv, a) == 0
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 3 * B and blocks == kv.get_block_ids("a")[:3]
    assert kv.allocate_slots(b, b.num_tokens - cached, blocks)
    assert kv.get_block_ids("b")[:3] == blocks
    assert len(kv.get_block_ids("b")) == 4
    for blk in blocks:
        assert kv.pool.ref_count(blk) == 2
        assert kv.pool.block_states[blk] == BLOCK_SHARED
    st = kv.kv_stats()
    assert st.num_shared == 3 and st.num_used == 5 + 0  # a: 4 blocks, b: 3 shared + 1 own
    assert st.prefix_queries == a.num_tokens + b.num_tokens
    assert st.prefix_hits == 3 * B
    kv.pool.check_invariants()


def test_freed_cached_blocks_are_revived_by_a_later_request():
    kv = KVCacheManager(8, B)
    prompt = list(range(2 * B + 1))
    a = make("a", prompt)
    admit_and_compute(kv, a)
    first_two = kv.get_block_ids("a")[:2]
    kv.free(a)
    assert [kv.pool.block_states[b] for b in first_two] == [BLOCK_CACHED] * 2
    c = make("c", prompt)
    assert admit_and_compute(kv, c) == 2 * B
    assert kv.get_block_ids("c")[:2] == first_two
    assert [kv.pool.block_states[b] for b in first_two] == [BLOCK_USED] * 2
    assert kv.kv_stats().num_cached == 0
    kv.pool.check_invariants()


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1, 2 * B, 2 * B + 1, 3 * B])
def test_prefix_hit_never_covers_the_last_token(n):
    kv = KVCacheManager(16, B)
    prompt = list(range(n))
    admit_and_compute(kv, make("a", prompt + [99] * B))  # caches every block of ``prompt``
    blocks, cached = kv.get_computed_blocks(make("b", prompt))
    assert cached <= n - 1 and cached % B == 0
    assert cached == ((n - 1) // B) * B
    assert len(blocks) * B == cached


def test_random_prompts_hit_at_most_all_but_the_last_token():
    rng = random.Random(7)
    kv = KVCacheManager(256, B)
    for i in range(60):
        n = rng.randint(1, 20)
        req = make(f"r{i}", [rng.choice((1, 2)) for _ in range(n)])
        cached = admit_and_compute(kv, req)
        assert cached % B == 0 and cached <= req.num_tokens - 1
        if rng.random() < 0.7:
            kv.free(req)
        kv.pool.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, B)
    a = make("a", list(range(2 * B)))
    assert kv.allocate_slots(a, 2 * B)
    b = make("b", list(range(50, 50 + 2 * B)))
    states = kv.pool.block_states.copy()
    assert not kv.allocate_slots(b, 2 * B)
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    assert (kv.pool.block_states == states).all()
    assert kv.allocate_slots(b, B)


def test_cached_free_blocks_count_as_allocatable_but_not_the_ones_being_revived():
    kv = KVCacheManager(3, B)
    a = make("a", list(range(2 * B + 1)))
    admit_and_compute(kv, a)           # 3 blocks, first two cached once full
    kv.free(a)
    assert kv.kv_stats().num_cached == 2 and kv.num_free_blocks == 3
    # Reviving both cached blocks and taking 2 new ones needs 4 > 3.
    b = make("b", list(range(2 * B + 1)) + [0] * (B + 2))
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 2 * B
    assert not kv.allocate_slots(b, b.num_tokens - cached, blocks)
    assert kv.kv_stats().num_cached == 2
    # A request with unrelated tokens may evict them.
    c = make("c", list(range(500, 500 + 3 * B)))
    assert kv.allocate_slots(c, 3 * B)
    assert kv.kv_stats().num_cached == 0
    kv.pool.check_invariants()


def test_free_releases_the_tail_first_so_it_is_evicted_first():
    kv = KVCacheManager(5, B)
    a = make("a", list(range(3 * B + 1)))
    admit_and_compute(kv, a)
    table = kv.get_block_ids("a")
    kv.free(a)
    assert kv.pool.free_list() == [4] + table[::-1]
    kv.allocate_slots(make("x", [9] * B), B)
    kv.allocate_slots(make("y", [8] * B), B)
    # Two allocations took the never-used block and the request's last block; the prefix stays.
    assert kv.pool.block_states[table[0]] == BLOCK_CACHED
    assert kv.pool.block_states[table[1]] == BLOCK_CACHED


def test_output_tokens_are_hashed_so_a_preempted_request_finds_its_own_blocks():
    kv = KVCacheManager(16, B)
    r = make("r", list(range(10)))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    kv.cache_blocks(r)
    for tok in (50, 51, 52):       # decode three tokens
        r.output_token_ids.append(tok)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_blocks(r)
    r.output_token_ids.append(53)  # sampled, KV not written yet: 14 tokens, 13 computed
    table = kv.get_block_ids("r")[:]
    kv.free(r)                     # preempted
    r.num_computed_tokens = 0
    blocks, cached = kv.get_computed_blocks(r)
    assert cached == 12 and blocks == table[:3]


def test_token_usage_and_fragmentation_count_shared_blocks_once():
    kv = KVCacheManager(10, B)
    st = kv.kv_stats()
    assert st.token_usage == 0 and st.fragmentation == 0 and st.usage == 0
    a = make("a", list(range(6)))
    admit_and_compute(kv, a)       # 2 blocks, 6 tokens written
    st = kv.kv_stats()
    assert st.num_used == 2
    assert st.token_usage == pytest.approx(6 / 40)
    assert st.fragmentation == pytest.approx(1 - 6 / 8)
    b = make("b", list(range(4)) + [77, 78])
    admit_and_compute(kv, b)       # shares block 0 (4 tokens), own block with 2
    st = kv.kv_stats()
    assert st.num_used == 3 and st.num_shared == 1
    assert st.token_usage == pytest.approx(8 / 40)
    assert st.fragmentation == pytest.approx(1 - 8 / 12)
    kv.free(a)
    kv.free(b)
    st = kv.kv_stats()
    assert st.num_used == 0 and st.token_usage == 0 and st.fragmentation == 0
    assert st.num_free + st.num_cached == 10


def test_slots_allocated_but_not_yet_written_are_not_stored():
    kv = KVCacheManager(10, B)
    a = make("a", list(range(6)))
    assert kv.allocate_slots(a, 6)
    assert kv.kv_stats().token_usage == 0
    a.num_computed_tokens = 3          # a chunk of 3 ran
    kv.cache_blocks(a)
    assert kv.pool.tokens_stored == 3
    a.num_computed_tokens = 6
    kv.cache_blocks(a)
    assert kv.pool.tokens_stored == 6


def test_prefix_caching_off_means_no_lookups_and_no_hashing():
    kv = KVCacheManager(16, B, enable_prefix_caching=False)
    prompt = list(range(3 * B))
    a, b = make("a", prompt), make("b", prompt)
    admit_and_compute(kv, a)
    assert kv.pool.num_cached_blocks == 0 and kv._block_hashes == {}
    assert all(kv.pool.block_hash(x) is None for x in kv.get_block_ids("a"))
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)
    st = kv.kv_stats()
    assert st.prefix_queries == 0 and st.num_cached == 0 and st.num_free == 16


def test_hot_toggle_of_prefix_caching_keeps_the_books_straight():
    kv = KVCacheManager(16, B)
    prompt = list(range(3 * B))
    done = make("done", prompt)
    admit_and_compute(kv, done)
    kv.free(done)
    live = make("live", list(range(40, 40 + 2 * B + 1)))
    admit_and_compute(kv, live)
    assert kv.pool.num_cached_blocks == 3  # the finished request's blocks

    kv.set_prefix_caching(False)
    assert kv.kv_stats().num_cached == 0
    assert BLOCK_CACHED not in kv.pool.block_states
    assert kv.get_computed_blocks(make("x", prompt)) == ([], 0)
    kv.pool.check_invariants()

    kv.set_prefix_caching(True)
    # The request that ran across the toggle registers its full blocks again.
    live.output_token_ids.append(5)
    assert kv.allocate_slots(live, 1)
    live.num_computed_tokens += 1
    kv.cache_blocks(live)
    probe = make("probe", live.all_token_ids[:2 * B] + [0])
    blocks, cached = kv.get_computed_blocks(probe)
    assert cached == 2 * B and blocks == kv.get_block_ids("live")[:2]
    kv.free(live)
    kv.pool.check_invariants()
    assert kv.kv_stats().num_used == 0


def test_kv_stats_counts_add_up_and_snapshot_is_a_copy():
    kv = KVCacheManager(12, B)
    a = make("a", list(range(2 * B + 2)))
    admit_and_compute(kv, a)
    b = make("b", list(range(2 * B)) + [9])
    admit_and_compute(kv, b)
    kv.free(a)
    st = kv.kv_stats()
    assert st.num_free + st.num_used + st.num_cached == st.num_blocks
    states = st.block_states
    assert int((states == BLOCK_FREE).sum()) == st.num_free
    assert int((states == BLOCK_CACHED).sum()) == st.num_cached
    assert int((states == BLOCK_USED).sum()) + int((states == BLOCK_SHARED).sum()) == st.num_used
    states[:] = 0
    assert kv.pool.block_states.any()


def test_a_resumed_request_does_not_count_as_a_prefix_query_again():
    kv = KVCacheManager(16, B)
    req = make("a", list(range(50, 50 + 3 * B + 1)))
    admit_and_compute(kv, req)
    queries, hits = kv.prefix_queries, kv.prefix_hits
    assert queries == req.num_tokens and hits == 0
    kv.free(req)  # preempted by recompute: its full blocks stay cached
    req.num_computed_tokens, req.num_preemptions = 0, 1
    assert admit_and_compute(kv, req) == 3 * B  # finds its own blocks again...
    assert (kv.prefix_queries, kv.prefix_hits) == (queries, hits)  # ...which is not a hit


def _twin_managers_step(seed: int, caching_flips: tuple[int, ...] = ()) -> None:
    """Two managers driven alike; each step one records the KV written per request
    (`cache_blocks`), the other for the whole step at once (`cache_step`)."""
    rng = random.Random(seed)
    per_req, per_step = KVCacheManager(48, B), KVCacheManager(48, B)
    for kv in (per_req, per_step):
        kv.enable_events()
    shared = [rng.randrange(50) for _ in range(3 * B)]
    reqs: list[tuple[Request, Request]] = []
    for i in range(6):
        prompt = shared[:rng.randint(0, 3 * B)] + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
        reqs.append((make(f"r{i}", prompt), make(f"r{i}", prompt)))
    for step in range(40):
        if step in caching_flips:
            for kv in (per_req, per_step):
                kv.set_prefix_caching(not kv.enable_prefix_caching)
        batch: list[tuple[Request, Request]] = []
        for a, b in reqs:
            if a.num_tokens >= 40:
                continue
            n = min(a.num_tokens - a.num_computed_tokens, rng.choice((1, 1, 1, 3, 7)))
            if n <= 0:
                a.output_token_ids.append(rng.randrange(50))
                b.output_token_ids.append(a.output_token_ids[-1])
                n = 1
            if a.num_computed_tokens == 0 and not per_req.get_block_ids(a.request_id):
                blocks_a, cached_a = per_req.get_computed_blocks(a)
                blocks_b, cached_b = per_step.get_computed_blocks(b)
                assert (blocks_a, cached_a) == (blocks_b, cached_b)
                a.num_computed_tokens = b.num_computed_tokens = cached_a
                n = min(n, a.num_tokens - cached_a)
                ok = per_req.allocate_slots(a, n, blocks_a)
                assert ok == per_step.allocate_slots(b, n, blocks_b)
            else:
                ok = per_req.allocate_slots(a, n)
                assert ok == per_step.allocate_slots(b, n)
            if ok:
                a.num_computed_tokens += n
                b.num_computed_tokens += n
                batch.append((a, b))
        for a, _ in batch:
            per_req.cache_blocks(a)
        per_step.cache_step([b for _, b in batch])
        assert per_req.take_events() == per_step.take_events()
        assert per_req.kv_stats().token_usage == per_step.kv_stats().token_usage
        for a, b in reqs:
            assert per_req.get_block_ids(a.request_id) == per_step.get_block_ids(b.request_id)
        for kv in (per_req, per_step):
            kv.pool.check_invariants()
        assert per_req.pool.free_list() == per_step.pool.free_list()
        assert per_req.pool.block_states.tolist() == per_step.pool.block_states.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_cache_step_records_a_step_as_cache_blocks_does_request_by_request(seed):
    _twin_managers_step(seed)


def test_cache_step_registers_blocks_that_lagged_while_prefix_caching_was_off():
    _twin_managers_step(7, caching_flips=(5, 12))


def test_lent_staging_blocks_are_held_by_running_requests_only():
    """A per-channel KV format (#48): every request with a table holds one more block, in no
    table, for its open block's staged keys; it is counted in what admission needs and what
    preempting frees, never lent twice, and freed with the table."""
    kv = KVCacheManager(6, B)
    lent = kv.lend_staging_blocks()
    assert kv.lend_staging_blocks() is lent and kv.staging is lent
    a, b = make("a", list(range(2 * B + 1))), make("b", list(range(50, 50 + B)))
    assert kv.blocks_needed(2 * B + 1) == 4 and kv.num_free_blocks_needed(a, a.num_tokens) == 4
    admit_and_compute(kv, a)                     # 3 blocks of table + 1 lent
    assert set(lent) == {"a"} and lent["a"] not in kv.get_block_ids("a")
    assert kv.num_blocks_of("a") == 4 and kv.num_free_blocks == 2 and kv.num_staging_blocks == 1
    assert kv.pool.block_states[lent["a"]] == BLOCK_USED
    # b needs 1 + 1: it fits; a third block for b would not (its lent one is not taken again).
    admit_and_compute(kv, b)
    assert kv.num_free_blocks == 0 and lent["b"] not in (*kv.get_block_ids("a"), lent["a"])
    assert kv.allocate_slots(b, B + 1) is False and kv.num_blocks_of("b") == 2
    # A request whose table fits but whose lent block does not is refused, nothing taken.
    kv.free(b)
    c = make("c", list(range(200, 200 + 2 * B)))
    assert kv.num_free_blocks == 2 and kv.num_free_blocks_needed(c, c.num_tokens) == 3
    assert kv.allocate_slots(c, c.num_tokens) is False and "c" not in lent
    kv.free(a)
    assert lent == {} and kv.num_free_blocks == 6 and kv.num_staging_blocks == 0
    kv.pool.check_invariants()
    with pytest.raises(RuntimeError, match="before any request"):
        admit_and_compute(k2 := KVCacheManager(4, B), make("x", [1, 2]))
        k2.lend_staging_blocks()


def test_without_lending_nothing_changes():
    kv = KVCacheManager(6, B)
    a = make("a", list(range(2 * B + 1)))
    assert kv.blocks_needed(2 * B + 1) == 3
    admit_and_compute(kv, a)
    assert kv.num_blocks_of("a") == 3 and kv.staging == {} and kv.num_staging_blocks == 0


def test_lent_staging_blocks_are_not_counted_as_fragmentation():
    """A lent block is used and holds no token by design: the blocks that hold tokens are what
    fragmentation is of (else 8 short requests read as half empty, and the advisor asks for
    smaller blocks, which would not help)."""
    plain, lending = KVCacheManager(64, B), KVCacheManager(64, B)
    lending.lend_staging_blocks()
    for kv in (plain, lending):
        for i in range(8):
            admit_and_compute(kv, make(f"r{i}", list(range(100 * i, 100 * i + 18))))
    assert lending.num_staging_blocks == 8
    assert lending.kv_stats().num_used == plain.kv_stats().num_used + 8
    assert lending.kv_stats().fragmentation == pytest.approx(plain.kv_stats().fragmentation)
    assert plain.kv_stats().fragmentation == pytest.approx(1 - 8 * 18 / (8 * 5 * B))


def test_a_scheduler_of_a_per_channel_format_lends_staging_as_the_engine_does():
    """The scheduler lends for int8_kivi / int4_kivi itself, so the what-if's simulation (the
    same scheduler) counts a block per running request as the engine does."""
    from vconsole.engine.sched.scheduler import Scheduler
    from vconsole.shared.config import EngineConfig

    for dtype, lends in (("int8_kivi", True), ("int4", True), ("int8", False), ("auto", False)):
        sched = Scheduler(EngineConfig(kv_cache_dtype=dtype), 64, B, 2048)
        assert (sched.kv._staging is not None) is lends, dtype
