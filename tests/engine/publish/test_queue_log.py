"""The queue's log (`QueueLog`), attached to a `WaitingQueue` as its listener: its rows, read
with numpy from the per-stay arrays, are the queue's requests in its order, whenever it was
attached and whatever the queue went through; its removal log and write numbers follow."""

from __future__ import annotations

import random

from support.scheduling import make_request
from vconsole.engine.publish.queue_log import QueueLog
from vconsole.engine.request import RequestStatus
from vconsole.engine.sched.request_queue import WaitingQueue


def assert_rows_are_the_queue(log: QueueLog, q: WaitingQueue) -> None:
    rows = log.rows(*log.row_order())
    want = q.ordered()
    assert len(log) == len(q)
    assert rows["id"] == [r.request_id for r in want]
    assert rows["state"].tolist() == [int(r.status) for r in want]
    assert rows["priority"].tolist() == [r.priority for r in want]
    assert rows["num_prompt_tokens"].tolist() == [r.num_prompt_tokens for r in want]
    assert rows["num_output_tokens"].tolist() == [len(r.output_token_ids) for r in want]
    assert rows["arrival"].tolist() == [r.arrival_time for r in want]


def test_the_rows_read_from_its_arrays_equal_reading_each_request_in_order():
    """`row_order` + `rows` list the requests `WaitingQueue.ordered` lists, with their rows,
    through adds, pops, removals, preemptions and policy changes (which re-key every stay); a
    log attached midway (the queue replays what waits) keeps up as one attached from the
    start."""
    rng = random.Random(1)
    for policy in ("fcfs", "priority", "hybrid"):
        q, n = WaitingQueue(policy, 0.7), 0
        log, late = QueueLog(), QueueLog()
        q.listen(log)
        for step in range(1500):
            x = rng.random()
            if x < 0.5:
                n += 1
                r = make_request(f"r{n}", rng.randint(1, 9), priority=rng.randint(0, 3),
                                 arrival=rng.random() * 10)
                r.seq_no = n
                if rng.random() < 0.2:
                    r.status = RequestStatus.PREEMPTED
                    r.output_token_ids = [5] * rng.randint(0, 4)
                q.add(r, 0.0)
            elif x < 0.7 and q:
                q.pop()
            elif x < 0.9 and q:
                q.remove(rng.choice(sorted(q._live)))
            elif x < 0.91:
                q.set_policy(rng.choice(("fcfs", "priority", "hybrid")), rng.choice((0.7, 2.0)))
            if step == 700:
                q.listen(late)
            if step % 50 == 0:
                assert_rows_are_the_queue(late if step >= 700 else log, q)


def test_removals_and_new_orders_are_logged_in_order():
    q, log = WaitingQueue("fcfs"), QueueLog()
    for i in range(5):
        q.add(make_request(f"r{i}", 4, priority=4 - i, arrival=float(i)), 0.0)
    q.listen(log)
    assert log.removed_since(0) == ([], 0)
    q.pop()
    q.remove("r3")
    q.remove("absent")
    removed, mark = log.removed_since(0)
    assert (removed, mark) == (["r0", "r3"], 2)
    q.set_policy("priority", 5.0)
    q.set_policy("priority", 5.0)                  # no change: no new order
    assert log.order_changes == 1
    assert log.rows(*log.row_order())["id"] == ["r4", "r2", "r1"]
    _, _, _, changes, _ = log.changes_since(0)
    assert changes == 5 + 2 + 2        # 5 added, 2 cleared, 2 re-keyed (r4 keeps class 0)
    slots, _, ids, _, _ = log.changes_since(changes - 2)
    assert sorted(ids) == ["r1", "r2"] and len(slots) == 2
