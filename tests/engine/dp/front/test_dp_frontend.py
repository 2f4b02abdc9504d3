"""The data-parallel front end's pure parts: routing, the request-id map, a rank's command line."""

from __future__ import annotations

from vconsole.engine.dp.front.request_map import RequestMap
from vconsole.engine.dp.front.router import choose_rank


def test_the_least_loaded_live_rank_gets_the_request() -> None:
    assert choose_rank([0, 1, 2], {0: 3, 1: 1, 2: 2}) == 1


def test_a_tie_goes_to_the_rank_with_the_emptier_kv_pool_then_the_lowest_rank() -> None:
    assert choose_rank([0, 1], {0: 2, 1: 2}, {0: 0.7, 1: 0.2}) == 1
    assert choose_rank([0, 1], {0: 2, 1: 2}, {0: 0.2, 1: 0.2}) == 0
    assert choose_rank([1, 0], {}, {}) == 0      # no load known yet: rank 0


def test_a_dead_rank_is_never_chosen_and_none_live_is_none() -> None:
    assert choose_rank([1], {0: 0, 1: 50}) == 1
    assert choose_rank([], {0: 0}) is None


def test_kv_usage_only_breaks_ties_it_never_outweighs_load() -> None:
    assert choose_rank([0, 1], {0: 1, 1: 2}, {0: 0.99, 1: 0.0}) == 0


def test_routing_spreads_a_burst_evenly() -> None:
    m = RequestMap()
    for i in range(10):
        live = [0, 1]
        m.add(b"c", str(i), choose_rank(live, m.load(live)))  # type: ignore[arg-type]
    assert m.load([0, 1]) == {0: 5, 1: 5}


def test_two_clients_may_use_the_same_id_and_get_distinct_rank_ids() -> None:
    m = RequestMap()
    a, b = m.add(b"a", "1", 0), m.add(b"b", "1", 0)
    assert a is not None and b is not None and a.fe_id != b.fe_id
    assert m.lookup(0, a.fe_id) == a and m.lookup(0, b.fe_id) == b


def test_a_duplicate_in_flight_id_of_one_client_is_refused() -> None:
    m = RequestMap()
    assert m.add(b"a", "x", 0) is not None
    assert m.add(b"a", "x", 1) is None
    assert m.load([0, 1]) == {0: 1, 1: 0}


def test_a_final_output_frees_the_id_and_the_load_once() -> None:
    m = RequestMap()
    e = m.add(b"a", "x", 1)
    assert e is not None
    assert m.pop(1, e.fe_id) == e
    assert m.pop(1, e.fe_id) is None
    assert m.load([1]) == {1: 0} and len(m) == 0
    assert m.add(b"a", "x", 0) is not None        # the id may be reused once finished


def test_a_dead_rank_takes_only_its_own_requests() -> None:
    m = RequestMap()
    on0 = [m.add(b"a", f"a{i}", 0) for i in range(3)]
    on1 = [m.add(b"b", f"b{i}", 1) for i in range(2)]
    failed = m.fail_rank(1)
    assert sorted(e.request_id for e in failed) == ["b0", "b1"]
    assert m.load([0, 1]) == {0: 3, 1: 0}
    assert all(m.lookup(0, e.fe_id) is not None for e in on0 if e)
    assert all(m.of_client(b"b", e.request_id) is None for e in on1 if e)


def test_a_client_that_left_has_all_its_requests_dropped() -> None:
    m = RequestMap()
    m.add(b"a", "1", 0)
    m.add(b"a", "2", 1)
    m.add(b"b", "1", 1)
    assert sorted((e.rank, e.request_id) for e in m.drop_client(b"a")) == [(0, "1"), (1, "2")]
    assert m.load([0, 1]) == {0: 0, 1: 1}

