"""Request ids scoped per client: unique engine ids, owners found back, numbers released."""

from vconsole.engine.process.request_registry import RequestRegistry


def test_two_clients_may_use_the_same_id_and_get_distinct_engine_ids():
    reg = RequestRegistry()
    a, b = reg.open(b"A", "r1"), reg.open(b"B", "r1")
    assert a is not None and b is not None and a != b
    assert reg.owner(a) == (b"A", "r1") and reg.owner(b) == (b"B", "r1")
    assert reg.lookup(b"A", "r1") == a and reg.lookup(b"B", "r1") == b


def test_a_client_cannot_open_an_id_it_has_in_flight_until_it_closes():
    reg = RequestRegistry()
    first = reg.open(b"A", "x")
    assert reg.open(b"A", "x") is None
    reg.close(first)
    assert reg.owner(first) is None and len(reg) == 0
    assert reg.open(b"A", "x") is not None


def test_ids_that_look_alike_never_collide():
    """Engine ids are "N:ID" with N per client, so no request id can forge another's."""
    reg = RequestRegistry()
    ids = [reg.open(c, r) for c, r in [(b"A", "1:x"), (b"B", "x"), (b"A", "x"), (b"1", "x")]]
    assert None not in ids and len(set(ids)) == 4


def test_a_clients_number_is_released_with_its_last_request():
    reg = RequestRegistry()
    e1, e2 = reg.open(b"A", "1"), reg.open(b"A", "2")
    assert sorted(reg.of_client(b"A")) == sorted([e1, e2])
    reg.close(e1)
    reg.close(e2)
    reg.close(e2)  # twice: ignored
    assert reg.of_client(b"A") == [] and reg.engine_ids() == []
    assert reg._clients == {}


def test_looking_up_an_id_that_is_not_a_string_finds_nothing():
    """A malformed message may name anything as its request id; the lookup must not raise
    (an unhashable id used to kill the engine's busy loop)."""
    reg = RequestRegistry()
    reg.open(b"A", "1")
    for junk in ([1], {"a": 1}, 1, None, b"1"):
        assert reg.lookup(b"A", junk) is None
