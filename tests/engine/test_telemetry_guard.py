"""Observability can never stop serving: a telemetry cache that raises on the busy loop is
logged once, counted, alerted and rebuilt, and every request still finishes exactly as it would
have without the fault.

The fault is injected inside the test (monkeypatch of the request table and of the latency
recorder): nothing in the engine knows about fault injection.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import pytest

from support.live_engine import Telemetry, ipc_endpoints, reference_outputs
from support.scheduling import make_request, make_scheduler
from vconsole.engine.client.client import EngineClient
from vconsole.engine.core import EngineCore
from vconsole.engine.latency import LatencyLog
from vconsole.engine.process.core_proc import EngineCoreProc
from vconsole.engine.process.telemetry_feed import TelemetryFeed
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.engine.telemetry_guard import TelemetryGuard
from vconsole.shared.config import EngineConfig


class InjectedFault(RuntimeError):
    pass


def test_a_failing_call_returns_the_default_is_counted_rebuilt_reported_and_logged_once(caplog):
    rebuilt, reported = [], []
    guard = TelemetryGuard(rebuild=rebuilt.append,
                           on_failure=lambda part, msg: reported.append((part, msg)))

    def boom() -> int:
        raise InjectedFault("row cache out of step")

    with caplog.at_level(logging.ERROR, logger="vconsole.engine"):
        assert guard.run("sched", boom, default=-1) == -1
        assert guard.run("sched", boom) is None
        assert guard.run("kv", lambda: 7) == 7
    assert guard.errors_total == 2 and guard.errors == {"sched": 2}
    assert rebuilt == ["sched", "sched"]
    assert reported == [("sched", "InjectedFault: row cache out of step")] * 2
    logged = [r for r in caplog.records if "telemetry (sched) failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None, "once, with its traceback"


def test_a_failing_rebuild_or_report_is_counted_and_never_raises():
    def broken(*_: object) -> None:
        raise InjectedFault("worse")

    guard = TelemetryGuard(rebuild=broken, on_failure=broken)
    assert guard.run("latency", lambda: 1 / 0) is None
    assert guard.errors_total == 3


def step(s) -> None:
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput({r: 7 for r in so.num_scheduled_tokens}))


class SchedulerOnly:
    """What the telemetry feed reads of a core for a snapshot, over a real scheduler."""

    def __init__(self, s: Scheduler) -> None:
        self.s, self.config, self.telemetry_guard, self.num_steps = s, s.config, s.telemetry, 0

    def scheduler_stats(self, max_rows, rows=None):
        return self.s.stats(max_rows, rows)

    def kv_stats(self):
        return self.s.kv_stats()


class Handover:
    """The publisher's side of a snapshot's hand-off, in this process: what it was handed."""

    mirrors_queue = False

    def __init__(self) -> None:
        self.snapshots: list = []

    def wants_text(self) -> bool:
        return False

    def submit_snapshot(self, sched, kv, state, num_steps, text=None) -> None:
        self.snapshots.append(sched)


def test_the_feed_makes_a_failed_request_table_afresh(monkeypatch):
    """The request table's caches are the feed's (`RequestRows`): when making it raises, the
    feed drops them, and the next snapshot reads the queue afresh (a new log on it)."""
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 8, max_tokens=3))
    step(s)
    pub = Handover()
    feed = TelemetryFeed(SchedulerOnly(s), pub, lambda: None)
    assert feed.submit_snapshot("running")
    rows, log = feed.rows.cached, feed.rows.log
    monkeypatch.setattr(rows, "table", lambda *a: (_ for _ in ()).throw(InjectedFault("x")))
    assert not feed.submit_snapshot("running") and s.telemetry.errors == {"sched": 1}
    assert feed.rows.cached is not rows and feed.rows.log is None, "the caches were dropped"
    step(s)
    assert feed.submit_snapshot("running")
    assert feed.rows.log is not log and s.waiting.listener is feed.rows.log
    assert [r.id for r in pub.snapshots[-1].requests] == [r.request_id for r in s.running] + [
        r.request_id for r in s.waiting.ordered()]


def test_the_scheduler_rebuilds_the_part_that_failed_from_scratch():
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 8, max_tokens=3))
    step(s)
    pool = s.kv.pool
    pool._tokens_stored += 5          # a telemetry counter out of step with the blocks
    pool.block_states[:] = 0
    s.rebuild_telemetry("kv")
    pool.check_invariants()

    s.latency.finished["length"] = 4
    old = s.latency
    s.rebuild_telemetry("latency")
    assert s.latency is not old and s.latency.finished == {"length": 4}


def test_latency_that_raises_inside_a_step_costs_no_token(monkeypatch):
    def run(fault: bool) -> dict[str, list[int]]:
        s = make_scheduler(num_blocks=64, max_num_seqs=4)
        if fault:
            monkeypatch.setattr(LatencyLog, "observe_many",
                                lambda *a: (_ for _ in ()).throw(InjectedFault("itl")))
        for i in range(4):
            s.add_request(make_request(f"r{i}", 5, max_tokens=4))
        while s.has_requests():
            step(s)
        return {"errors": [s.telemetry.errors.get("latency", 0)],
                "tokens": [s.num_generation_tokens_total, s.num_finished_total]}

    clean, faulty = run(False), run(True)
    assert faulty["tokens"] == clean["tokens"] == [16, 4]
    assert faulty["errors"][0] > 0 and clean["errors"] == [0]


@contextlib.contextmanager
def busy_loop(core: EngineCore, tmp_path) -> Iterator[tuple[dict[str, str], Telemetry,
                                                          threading.Thread]]:
    """``core`` behind a real EngineCoreProc on ipc:// sockets, its busy loop on a thread:
    (endpoints, a telemetry subscriber, the loop's thread); shut down afterwards."""
    eps = ipc_endpoints(tmp_path)
    proc = EngineCoreProc(core.config, eps, core=core)
    proc.start()
    telemetry = Telemetry(eps["telemetry"])
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop")
    loop.start()
    try:
        yield eps, telemetry, loop
    finally:
        telemetry.close()
        proc.request_shutdown("test cleanup")
        loop.join(30)


PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46], [9, 9, 9, 9],
           [11, 12], [30, 31, 32, 33, 34, 35], [2, 3, 4], [60, 61, 62, 63]]
MAX_TOKENS = 12


@pytest.mark.proc
@pytest.mark.slow
def test_an_injected_snapshot_failure_leaves_serving_untouched(tmp_path, monkeypatch):
    """The real busy loop, real sockets (ipc://), the tiny model: the scheduler's snapshot raises
    on every other snapshot and latency on every observation, while eight requests share two
    seats. Each request's greedy output equals the reference; health counts the failures and
    an alert says so."""
    expected = reference_outputs([(p, MAX_TOKENS) for p in PROMPTS], block_size=4)
    calls = {"n": 0}
    real_stats = Scheduler.stats

    def flaky_stats(self, *args):
        calls["n"] += 1
        if calls["n"] % 2:
            raise InjectedFault(f"snapshot {calls['n']}")
        return real_stats(self, *args)

    monkeypatch.setattr(Scheduler, "stats", flaky_stats)
    monkeypatch.setattr(LatencyLog, "observe",
                        lambda *a: (_ for _ in ()).throw(InjectedFault("ttft")))
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path / "run"))
    core = EngineCore(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, block_size=4,
                                   max_num_seqs=2, telemetry_hz=50))
    with busy_loop(core, tmp_path) as (eps, telemetry, loop):
        # Subscribed before the first request: the latency part's telemetry_error alert is an
        # event sent once per 30 s, and a subscriber that joins late (a starved machine: PUB/SUB
        # drops what is sent before the subscription arrives) would never hear it.
        telemetry.wait_for("health", lambda p: True, timeout_s=30)
        with EngineClient(eps["input"], eps["output"], timeout_s=60) as client:
            ids = [client.submit(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS]
            tokens = {rid: [] for rid in ids}
            finals = {}
            for rid in ids:
                for out in client.stream(rid):
                    tokens[rid].extend(out.new_token_ids)
                    if out.finished:
                        finals[rid] = out
        assert all(finals[r].finish_reason in ("length", "stop") for r in ids)
        assert [tokens[r] for r in ids] == expected
        assert calls["n"] >= 2 and core.telemetry_guard.errors["sched"] >= 1
        assert core.telemetry_guard.errors["latency"] >= len(PROMPTS)
        health = telemetry.wait_for("health", lambda p: p.get("telemetry_errors", 0) > 0,
                                    timeout_s=15)
        assert health["state"] in ("idle", "running")
        alert = telemetry.wait_for("alert", lambda p: p["name"] == "telemetry_error")
        assert "serving goes on" in alert["message"]
        telemetry.wait_for("sched", lambda p: p["num_finished_total"] == len(PROMPTS))
        assert loop.is_alive(), "the busy loop survived every fault"


@pytest.mark.proc
def test_a_failed_snapshot_of_the_drained_engine_is_sent_again_not_left_stale(tmp_path,
                                                                               monkeypatch):
    """The snapshot that shows an engine gone idle is the last one before the loop blocks: when
    a part of it raises, the loop wakes once more and sends it, so a console never keeps the
    busy picture of an idle engine."""
    real_stats = Scheduler.stats
    failed = {"idle": 0}

    def stats_failing_once_idle(self, *args):
        if not self.running and self.num_finished_total == 1 and not failed["idle"]:
            failed["idle"] += 1
            raise InjectedFault("first snapshot of the drained engine")
        return real_stats(self, *args)

    monkeypatch.setattr(Scheduler, "stats", stats_failing_once_idle)
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path / "run"))
    core = EngineCore(EngineConfig(model="tiny", device="cpu", num_kv_blocks=32, block_size=4,
                                   max_num_seqs=2, telemetry_hz=20))
    with busy_loop(core, tmp_path) as (eps, telemetry, _):
        with EngineClient(eps["input"], eps["output"], timeout_s=60) as client:
            rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=4)
            assert list(client.stream(rid))[-1].finished
        telemetry.wait_for("sched", lambda p: p["num_finished_total"] == 1, timeout_s=15)
        assert failed["idle"] == 1, "the drained snapshot failed once"
        assert core.telemetry_guard.errors["sched"] == 1
