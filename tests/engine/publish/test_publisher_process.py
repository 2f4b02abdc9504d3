"""The publisher in a child process (`vconsole.engine.publish.publisher_process`): what only a
process has — its hand-off's wire form, its own /metrics, its death and restart, its exit with
the engine — with real processes and sockets. (What a subscriber sees from it is
tests/engine/publish/test_publisher.py, run on both the thread and the process.)"""

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest
import zmq

from vconsole.engine.publish import handoff_wire as wire
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, RequestTable, SchedulerStats, StepStats
from vconsole.telemetry.schema import decode

FAST = dict(telemetry_hz=20.0, heartbeat_interval_s=0.1, config_interval_s=0.3)


def table(ids):
    n = len(ids)
    return RequestTable({"id": list(ids), "state": np.arange(n, dtype=np.uint8) % 3,
                         "priority": np.arange(n, dtype=np.int32),
                         "num_prompt_tokens": np.full(n, 20, np.int32),
                         "num_output_tokens": np.arange(n, dtype=np.int32) * 2,
                         "num_blocks": np.ones(n, np.int32),
                         "constraint": np.zeros(n, np.uint8),
                         "compile_ms": np.zeros(n, np.float32),
                         "age_s": np.linspace(0.0, 1.0, n)})


def snapshot(ids=("a", "b", "c")):
    sched = SchedulerStats(num_waiting=2, num_running=1, num_preempted=0,
                           num_preemptions_total=3, max_num_seqs=32, max_num_batched_tokens=512,
                           policy="fcfs", num_finished_total=9, requests=table(ids))
    states = np.zeros(64, np.uint8)
    states[:5] = 1
    kv = KVStats(num_blocks=64, block_size=16, num_free=59, num_used=5, num_cached=0,
                 num_shared=0, usage=5 / 64, token_usage=0.05, fragmentation=0.1,
                 prefix_queries=10, prefix_hits=4, block_states=states)
    return sched, kv


def step(i=0, start_ns=0):
    return StepStats(100_000, 8_000_000, 400_000, 8_500_000 + i, 32, 4, 5, num_finished=1,
                     start_ns=start_ns)


def round_trip(frames):
    return wire.decode([memoryview(f) if not isinstance(f, bytes) else f for f in frames])


@pytest.mark.parametrize("ids", [["req-1", "req-2", "x\0y"], ["req-1", "ünï", "3"], [], [""]],
                         ids=["separator-in-an-id", "utf8", "empty", "one-empty-id"])
def test_a_snapshot_crosses_the_handoff_field_for_field(ids):
    sched, kv = snapshot(ids)
    steps = wire.Steps(wire.step_records([step(1, start_ns=5_000_000_000), step(2)]), lost=3)
    frames = wire.snapshot_frames(wire.Snapshot(sched, kv, "running", 7, 123.5,
                                                {"req-1": ["hi", "there"]}, steps))
    assert sched.requests.columns["id"] == ids        # the caller's table is left as it was
    kind, got = round_trip(frames)
    assert kind == wire.SNAPSHOT
    assert (got.state, got.num_steps, got.wall, got.text) == ("running", 7, 123.5,
                                                              {"req-1": ["hi", "there"]})
    cols, sent = got.sched.requests.columns, sched.requests.columns
    assert cols["id"] == ids
    for c in sent:
        if c != "id":
            assert cols[c].dtype == sent[c].dtype, c
            np.testing.assert_array_equal(cols[c], sent[c])
    assert {**vars(got.sched), "requests": None} == {**vars(sched), "requests": None}
    np.testing.assert_array_equal(got.kv.block_states, kv.block_states)
    assert {**vars(got.kv), "block_states": None} == {**vars(kv), "block_states": None}
    (first, end), (second, no_end) = (wire.step_stats(r) for r in got.steps.records)
    assert (first.total_ns, first.num_finished, end) == (8_500_001, 1, 5.008500001)
    assert (second.total_ns, no_end) == (8_500_002, None) and got.steps.lost == 3


def test_the_publisher_process_imports_no_torch():
    code = ("import sys, vconsole.engine.publish.publisher_child; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def pub(ctx):
    p = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-5", 1, EngineConfig(**FAST),
                           process=True, metrics=("127.0.0.1", 0), model_name="tiny")
    p.start()
    yield p
    p.close()


def subscribe(ctx, endpoint, topics=(b"",)):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    for t in topics:
        sub.subscribe(t)
    sub.connect(endpoint)
    return sub


def collect(sub, seconds, until):
    out, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if sub.poll(int(left * 1000) + 1):
            out.append(decode(sub.recv_multipart(copy=False)))
            if until(out):
                break
    return out


def test_health_names_the_engine_process_and_its_last_step(ctx, pub):
    sub = subscribe(ctx, pub.endpoint, (b"health", b"host"))
    now_ns = time.monotonic_ns()
    pub.set_state("running")
    pub.record_step(step(start_ns=now_ns))
    pub.set_state("idle")
    msgs = collect(sub, 5, until=lambda ms: any(
        m.topic == "health" and m.payload["steps"] == 1 for m in ms)
        and any(m.topic == "host" for m in ms))
    health = next(m.payload for m in msgs if m.topic == "health" and m.payload["steps"] == 1)
    assert health["pid"] == os.getpid() != pub.child.pid
    # Read live from the engine's counters: no older than the step itself.
    assert 0 <= health["last_step_age_s"] <= time.monotonic() - now_ns / 1e9
    host = next(m.payload for m in msgs if m.topic == "host")
    assert host["pid"] == os.getpid()


def test_metrics_are_served_by_the_publisher_process_from_what_it_sent(ctx, pub):
    sub = subscribe(ctx, pub.endpoint, (b"sched",))
    sched, kv = snapshot(ids=[f"r{i}" for i in range(3)])
    pub.submit_snapshot(sched, kv, "running", 1)
    assert collect(sub, 5, until=lambda ms: bool(ms))
    # (the sender notes its last message just after sending it)
    deadline = time.monotonic() + 5
    while True:
        text = urllib.request.urlopen(pub.metrics_url, timeout=5).read().decode()
        if "vllm:num_requests_running{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert 'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0' in text


def test_a_killed_publisher_process_is_restarted_and_says_so(ctx, pub):
    first = pub.child.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (pub.child.pid == first or not pub.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pub.child.pid != first and pub.is_alive()
    sub = subscribe(ctx, pub.endpoint, (b"alert", b"health", b"sched"))
    msgs = collect(sub, 10, until=lambda ms: any(m.topic == "alert" for m in ms))
    alert = next(m.payload for m in msgs if m.topic == "alert")
    assert alert["name"] == "telemetry_error" and "killed by SIGKILL" in alert["message"]
    # The engine side never noticed: its hand-offs reach the new process.
    sched, kv = snapshot(ids=["after-restart"])
    pub.submit_snapshot(sched, kv, "running", 3)
    msgs = collect(sub, 5, until=lambda ms: {"sched", "health"} <= {m.topic for m in ms})
    assert next(m.payload for m in msgs if m.topic == "sched")["requests"].ids == \
        ["after-restart"]
    health = [m.payload for m in msgs if m.topic == "health"][-1]
    assert health["telemetry_errors"] >= 1 and health["pid"] == os.getpid()


def test_close_stops_the_process_and_reports_what_it_sent(ctx):
    p = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-5", 0, EngineConfig(**FAST),
                           process=True)
    p.start()
    child = p.child
    sub = subscribe(ctx, p.endpoint, (b"health", b"step"))
    # Joined once a heartbeat arrives (a step sent before would be lost to the slow joiner).
    assert collect(sub, 30, until=lambda ms: any(m.topic == "health" for m in ms))
    p.record_step(step())
    # Something to report: a health and a step message have gone out.
    seen = collect(sub, 30, until=lambda ms: any(m.topic == "step" for m in ms))
    assert any(m.topic == "step" for m in seen)
    sub.close(0)
    p.close()
    assert not p.is_alive() and child.pid is not None
    assert p.sent["health"] >= 1 and p.sent["step"] >= 1
    assert not os.path.exists(child._dir)        # the hand-off's folder is gone


def test_a_bind_failure_raises_as_the_bind_does(ctx, pub):
    other = TelemetryPublisher(ctx, pub.endpoint, "engine-8", 0, EngineConfig(), process=True)
    with pytest.raises(zmq.ZMQError):
        other.start()
    assert not other.is_alive()


def test_the_publisher_process_exits_when_the_engine_is_killed(tmp_path):
    # The "engine": a process that starts a publisher process, says its pid, then waits.
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, zmq
        from vconsole.engine.publish.publisher import TelemetryPublisher
        from vconsole.shared.config import EngineConfig
        pub = TelemetryPublisher(zmq.Context(), "tcp://127.0.0.1:*", "e", 0, EngineConfig(),
                                 process=True)
        pub.start()
        print(pub.child.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(engine.stdout.readline())
        os.kill(child, 0)                          # it runs
        engine.kill()                              # kill -9 of the engine
        engine.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the publisher process outlived the engine"
    finally:
        engine.kill()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"    # a zombie is dead, not reaped
    except FileNotFoundError:
        return False
