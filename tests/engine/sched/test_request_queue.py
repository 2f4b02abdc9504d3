"""The waiting queue's change hook: one listener hears every stay that begins and ends and every
new order, after the change; attached late, it first hears what waits; a queue nobody listens
to keeps no record for anyone."""

from __future__ import annotations

from support.scheduling import make_request
from vconsole.engine.request import RequestStatus
from vconsole.engine.sched.request_queue import Entry, Key, WaitingQueue


class Recorder:
    """A listener that writes down what it hears, and what the queue held when it heard it."""

    def __init__(self, queue: WaitingQueue) -> None:
        self.queue = queue
        self.heard: list[tuple] = []

    def added(self, entry: Entry) -> None:
        key, counter, req = entry
        assert req.request_id in self.queue
        self.heard.append(("added", req.request_id, key, counter))

    def removed(self, request_id: str) -> None:
        assert request_id not in self.queue
        self.heard.append(("removed", request_id))

    def reordered(self, changed: list[tuple[str, Key]]) -> None:
        assert self.queue.policy == "priority"
        self.heard.append(("reordered", sorted(changed)))


def test_the_listener_hears_every_change_after_it_is_made():
    q = WaitingQueue("fcfs")
    a, b, c = (make_request(rid, 4, priority=p, arrival=float(i))
               for i, (rid, p) in enumerate([("a", 2), ("b", 0), ("c", 1)]))
    for seq, r in enumerate((a, b, c), 1):
        r.seq_no = seq
    q.add(a, 0.0)
    rec = Recorder(q)
    q.listen(rec)
    assert rec.heard == [("added", "a", (0.0, 1, 1), 1)]     # what waited when it came
    q.add(b, 0.0)
    q.add(c, 0.0)
    q.remove("c")
    assert q.pop() is a
    a.status = RequestStatus.PREEMPTED
    q.add(a, 1.0)                                           # back: a new stay
    q.set_policy("priority", 5.0)
    assert q.pop_expired(10.0) == [b]
    assert rec.heard[1:] == [
        ("added", "b", (0.0, 1, 2), 2), ("added", "c", (0.0, 1, 3), 3),
        ("removed", "c"), ("removed", "a"), ("added", "a", (0.0, 0, 1), 4),
        ("reordered", [("a", (2.0, 0, 1))]), ("removed", "b")]   # b's key is the same


def test_a_detached_listener_hears_nothing_more():
    q = WaitingQueue("priority")
    rec = Recorder(q)
    q.listen(rec)
    q.add(make_request("a", 4), 0.0)
    q.listen(None)
    q.pop()
    q.set_policy("priority", 1.0)
    assert [h[0] for h in rec.heard] == ["added"] and q.listener is None
