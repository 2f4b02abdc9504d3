"""The publisher process's mirror of the waiting queue (`vconsole.engine.publish.queue_mirror`):
each snapshot carries what changed in the queue's log since the last one the process got, and
the process joins from its mirror the table the engine's own cached rows would have made."""

from __future__ import annotations

import numpy as np

from support.scheduling import make_request
from vconsole.engine.publish import handoff_wire as wire
from vconsole.engine.publish import queue_log
from vconsole.engine.publish.queue_log import QueueLog
from vconsole.engine.publish.queue_mirror import MirroredTable, SyncSender
from vconsole.engine.publish.request_rows import (
    QueueRows,
    RequestRows,
    WaitingRows,
    head_columns,
    head_rows,
)
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.shared.stats import KVStats, RequestTable, SchedulerStats


def snapshot():
    sched = SchedulerStats(num_waiting=2, num_running=1, num_preempted=0,
                           num_preemptions_total=3, max_num_seqs=32, max_num_batched_tokens=512,
                           policy="fcfs", num_finished_total=9)
    kv = KVStats(num_blocks=64, block_size=16, num_free=64, num_used=0, num_cached=0,
                 num_shared=0, usage=0.0, token_usage=0.0, fragmentation=0.0,
                 prefix_queries=0, prefix_hits=0, block_states=np.zeros(64, np.uint8))
    return sched, kv


def queue_of(n):
    """A queue of ``n`` requests and its log (attached first: what a publisher listens to)."""
    q, log = WaitingQueue("fcfs"), QueueLog()
    q.listen(log)
    for i in range(n):
        q.add(make_request(f"req-{i}", 4 + i % 7, priority=i % 3, arrival=float(i)), 0.0)
    return q, log


def head():
    r = make_request("run-0", 12, arrival=0.5)
    r.output_token_ids = [5, 6]
    return head_rows([r], {"run-0": [1, 2]})


def cross(log, sender, mirror, now, ok=True):
    """One snapshot whose waiting rows are left to the mirror: (the table the process joined,
    the frames' bytes). ``ok``: whether the send went."""
    sched, kv = snapshot()
    sched.requests = RequestTable(parts=QueueRows(head(), log, 5000, now))
    frames = wire.snapshot_frames(wire.Snapshot(sched, kv, "running", 1, 0.0, None,
                                                wire.Steps([])), sender)
    sender.sent(ok)
    size = sum(len(f) for f in frames)
    if not ok:
        return None, size
    kind, got = wire.decode(frames, mirror)
    assert kind == wire.SNAPSHOT
    return got.sched.requests, size


def same_rows(a, b):
    ca, cb = a.columns, b.columns
    assert list(ca) == list(cb) and ca["id"] == cb["id"]
    for c in ca:
        if c != "id":
            assert ca[c].dtype == cb[c].dtype, c
            np.testing.assert_array_equal(ca[c], cb[c], err_msg=c)


def test_the_waiting_rows_are_joined_from_a_mirror_of_the_queue():
    """The process joins, from its mirror, the table the engine's own cached rows make (same
    refresh points), while each snapshot carries only what changed in the queue: admissions,
    removals from the middle, arrivals, a re-keying policy change, a refused send."""
    q, log = queue_of(5000)
    sender, mirror = SyncSender(), MirroredTable(refresh_s=3600)
    engine_rows = WaitingRows(refresh_s=3600)       # what the engine process would send

    def check(now, ok=True):
        got, size = cross(log, sender, mirror, now, ok)
        if got is not None:
            same_rows(got, engine_rows.joined(head_columns(head(), now), log, 5000, now))
        return got, size

    got, first = check(10.0)
    assert len(got) == 5001 and got.columns["id"][:2] == ["run-0", "req-0"]
    assert got.columns["age_s"][1] == 10.0
    q.pop()
    q.pop()                                            # admitted
    q.remove("req-100")
    q.remove("req-4000")                               # aborted from the middle
    got, size = check(11.5)
    assert got.columns["id"][1] == "req-2" and "req-100" not in got.columns["id"]
    assert size * 50 < first                           # what changed, not the rows
    for i in range(5000, 5010):                        # arrivals (shown after a refresh)
        q.add(make_request(f"req-{i}", 4, arrival=float(i)), 0.0)
    q.pop()
    check(12.0, ok=False)                              # refused: the next carries it too
    q.pop()
    got, size = check(12.5)
    assert got.columns["id"][1] == "req-4" and size * 50 < first
    q.set_policy("priority", 5.0)                      # every stay re-keyed
    engine_rows.invalidate()                           # (as `RequestRows` does)
    got, _ = check(13.0)
    assert got.columns["priority"][1:200].tolist() == [0] * 199
    sender.reset()                                     # a restarted process: all again
    mirror = MirroredTable(refresh_s=3600)
    engine_rows = WaitingRows(refresh_s=3600)
    _, size = check(14.0)
    assert size * 2 > first


def test_a_mirror_applies_only_the_sync_that_starts_where_it_stands(monkeypatch):
    """A sync lost on the way (or a fresh mirror) is refused — the process asks for the whole
    queue — never applied on the wrong base; the write log keeps its newer half when it is
    trimmed, so a reader near its end still gets only what it missed."""
    monkeypatch.setattr(queue_log, "MAX_WRITE_LOG", 16)
    q, log = queue_of(8)
    sender, mirror = SyncSender(), MirroredTable(refresh_s=3600)
    assert mirror.wants_full
    first = sender.sync(log)
    assert first.full and mirror.apply(first) and not mirror.wants_full
    sender.sent(True)
    q.pop()
    lost = sender.sync(log)
    sender.sent(True)                     # the engine thinks it went; the process never got it
    q.pop()
    later = sender.sync(log)
    assert not mirror.apply(later)        # it starts after the lost one: refused
    assert mirror.apply(lost) and mirror.apply(later)   # in order, they apply
    sender.sent(True)
    for i in range(40):                   # slots freed and reused: the log is trimmed
        q.add(make_request(f"new-{i}", 4, arrival=100.0 + i), 0.0)
        q.pop()
    st = log.stays
    assert st.log_base > 0 and len(st.log) <= 2 * max(16, 2 * st.high)
    tail = sender.sync(log)
    assert tail.base is not None and len(tail.slots) <= st.high
    assert mirror.apply(tail)
    np.testing.assert_array_equal(mirror.mirror._stays.records[:st.high], st.records[:st.high])
    assert mirror.mirror._stays.ids[:st.high].tolist() == st.ids[:st.high].tolist()


def test_a_new_log_is_sent_whole():
    """The rows' log started over (`RequestRows.reset`, after the ``sched`` part failed): the
    sender's write numbers are the old log's, so its next sync is full and the mirror starts
    over from it."""
    q, rows = queue_of(20)[0], RequestRows(mirrored=True)
    q.listen(None)
    sender, mirror = SyncSender(), MirroredTable(refresh_s=3600)
    first = rows.log_of(q)
    assert mirror.apply(sender.sync(first))
    sender.sent(True)
    q.pop()
    assert not sender.sync(first).full
    sender.sent(True)
    rows.reset()
    q.pop()
    again = sender.sync(rows.log_of(q))
    assert again.full and mirror.apply(again)
    sender.sent(True)
    assert mirror.table(head_columns(head(), 1.0), 100, 1.0).columns["id"] == (
        ["run-0"] + [r.request_id for r in q.ordered()])
