"""The ``sched`` request table as the publishing side makes it (`RequestRows`), between two
rebuilds of its cached waiting rows: running rows are exact, no request is listed twice, ages
follow the clock, and a policy change re-orders."""

from __future__ import annotations

from support.scheduling import make_request, make_scheduler
from vconsole.engine.publish import request_rows
from vconsole.engine.publish.queue_log import QueueLog
from vconsole.engine.publish.request_rows import RequestRows, WaitingRows
from vconsole.engine.request import RequestStatus
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.shared.stats import RequestRow, RequestTable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def step(s) -> None:
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput({r: 7 for r in so.num_scheduled_tokens}))


def scheduler(clock: Clock, n: int = 40, **cfg: object):
    s = make_scheduler(num_blocks=256, clock=clock, max_num_seqs=4, **cfg)
    for i in range(n):
        s.add_request(make_request(f"r{i:02d}", 8, max_tokens=3, priority=i % 3,
                                   arrival=clock.t - 1 + i * 0.01))
    return s


def test_rows_are_running_then_waiting_in_queue_order():
    clock = Clock()
    s = scheduler(clock)
    step(s)
    st = s.stats(100, RequestRows())
    assert isinstance(st.requests, RequestTable) and len(st.requests) == 40
    ids = [r.id for r in st.requests]
    assert ids[:4] == [r.request_id for r in s.running]
    assert ids[4:] == [r.request_id for r in s.waiting.ordered()]
    assert st.requests[0] == RequestRow(ids[0], "running", 0, 8, 1, s.kv.num_blocks_of(ids[0]),
                                        st.requests[0].age_s)
    assert {r.state for r in st.requests[4:]} == {"waiting"}


def test_between_rebuilds_admitted_requests_are_not_listed_twice_and_ages_move():
    clock = Clock()
    s, rows = scheduler(clock), RequestRows()
    step(s)
    first = s.stats(100, rows)
    rebuilds = rows.cached.rebuilds
    for _ in range(4):            # requests finish, others are admitted from the queue
        step(s)
    clock.t += 0.5
    st = s.stats(100, rows)
    assert rows.cached.rebuilds == rebuilds            # the cached waiting rows were reused
    ids = [r.id for r in st.requests]
    assert len(ids) == len(set(ids))                   # admitted ones left the waiting rows
    assert ids[:len(s.running)] == [r.request_id for r in s.running]
    assert set(ids) <= {r.request_id for r in s.running} | set(s.waiting._live)
    assert len(first.requests) == 40 and first.requests[10].state == "waiting"
    by_id = {r.id: r for r in st.requests}
    old = {r.id: r for r in first.requests}
    waiting_id = ids[-1]
    assert abs(by_id[waiting_id].age_s - old[waiting_id].age_s - 0.5) < 1e-9


def test_a_policy_change_or_a_shrunken_queue_rebuilds_the_rows():
    clock = Clock()
    s, rows = scheduler(clock, policy="fcfs"), RequestRows(refresh_s=3600)
    step(s)
    s.stats(100, rows)
    s.update_config(s.config.__class__(**{**s.config.to_dict(), "policy": "priority"}))
    step(s)
    st = s.stats(100, rows)
    waiting = [r for r in st.requests if r.state != "running"]
    assert [r.priority for r in waiting] == sorted(r.priority for r in waiting)
    s.abort_requests([r.id for r in waiting[:30]])
    step(s)
    ids = [r.id for r in s.stats(100, rows).requests]
    assert not set(ids) & {r.id for r in waiting[:30]}


def test_a_request_leaving_the_queue_twice_between_rebuilds_keeps_ids_and_columns_in_step():
    """The demo's crash: admitted, preempted back, admitted again between two rebuilds put the
    same id twice in the queue's removal log; ids and columns fell out of step."""
    q, log, rows = WaitingQueue("fcfs"), QueueLog(), WaitingRows(refresh_s=3600)
    q.listen(log)
    reqs = [make_request(f"r{i}", 4, arrival=float(i)) for i in range(4)]
    for r in reqs:
        q.add(r, 0.0)
    rows.table([], {}, log, 10, 1.0)                   # the cached rows: r0..r3
    a = q.pop()                                        # r0 admitted
    a.status = RequestStatus.PREEMPTED
    q.add(a, 1.0)                                      # preempted back
    assert q.pop() is a                                # admitted again
    t = rows.table([], {}, log, 10, 2.0)
    assert t.columns["id"] == ["r1", "r2", "r3"]
    assert all(len(v) == 3 for v in t.columns.values())
    q.remove("r2")
    assert rows.table([], {}, log, 10, 3.0).columns["id"] == ["r1", "r3"]


def test_a_timed_refresh_is_spread_over_snapshots_and_the_old_rows_serve_meanwhile(monkeypatch):
    """A refresh that is due reads `REFRESH_CHUNK` positions of the queue order per snapshot;
    until it completes, snapshots show the previous rows (minus those that left). Complete, the
    rows are the queue's order at its start minus every request that left since."""
    monkeypatch.setattr(request_rows, "REFRESH_CHUNK", 4)
    q, log, rows = WaitingQueue("fcfs"), QueueLog(), WaitingRows(refresh_s=3600)
    q.listen(log)
    for i in range(10):
        q.add(make_request(f"a{i}", 4, arrival=float(i)), 0.0)
    first = rows.table([], {}, log, 10, 1.0).columns["id"]    # at once: nothing cached yet
    assert first == [f"a{i}" for i in range(10)] and rows.rebuilds == 1
    for i in range(4):
        q.add(make_request(f"b{i}", 4, arrival=10.0 + i), 0.0)
    rows._next_rebuild = 0.0                                   # a timed refresh is due
    at_start = [r.request_id for r in q.ordered()]
    tables, waiting = [], []
    while rows.rebuilds == 1:
        q.pop()                                                # one admitted per step
        tables.append(rows.table([], {}, log, 10, 2.0).columns["id"])
        waiting.append([r.request_id for r in q.ordered()])
        assert len(tables) < 10, "the refresh never completed"
    assert len(tables) > 1, "the refresh took several snapshots"
    for ids, now_waiting in zip(tables[:-1], waiting, strict=False):   # the old rows, shrinking
        assert ids == [rid for rid in first if rid in now_waiting]
    assert tables[-1] == [rid for rid in at_start if rid in waiting[-1]][:10]
    assert "b0" in tables[-1], "requests queued before the refresh now show"


def test_the_log_is_attached_at_the_first_table_and_starts_over_after_a_reset():
    """Requests queued before the first table are in it (attaching replays the queue); after
    `reset` (the ``sched`` part failed) a new log and new cached rows read the queue afresh;
    another listener put in its place is noticed."""
    clock = Clock()
    s, rows = scheduler(clock, n=12), RequestRows(refresh_s=3600)
    assert s.waiting.listener is None
    step(s)
    want = [r.request_id for r in s.running] + [r.request_id for r in s.waiting.ordered()]
    assert [r.id for r in s.stats(100, rows).requests] == want
    log = rows.log
    assert log is not None and s.waiting.listener is log and len(log) == len(s.waiting)
    rows.reset()
    assert [r.id for r in s.stats(100, rows).requests] == want
    assert rows.log is not log and s.waiting.listener is rows.log
    s.waiting.listen(None)
    step(s)
    want = [r.request_id for r in s.running] + [r.request_id for r in s.waiting.ordered()]
    assert [r.id for r in s.stats(100, rows).requests] == want


def test_a_mirrored_table_leaves_the_waiting_rows_to_the_log_and_joins_as_the_cached_one():
    """``mirrored``: the busy loop's table is its running rows and the queue's log (a
    `QueueRows`, which a publisher process joins from its mirror); joined here it is the table
    the cached rows make at a refresh."""
    clock = Clock()
    s = scheduler(clock)
    step(s)
    mirrored = s.stats(100, RequestRows(mirrored=True)).requests
    assert isinstance(mirrored, RequestTable)
    assert isinstance(mirrored.parts, request_rows.QueueRows)
    assert mirrored.parts.first_ids(6) == [r.id for r in s.stats(6, RequestRows()).requests]
    assert list(mirrored) == list(s.stats(100, RequestRows()).requests)
