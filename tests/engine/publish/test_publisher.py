"""TelemetryPublisher over real PUB/SUB sockets on 127.0.0.1, with its real thread — in this
process, and in a publisher process (``process=True``, as the engine process runs it): every
test here runs on both, so a subscriber sees the same telemetry from either."""

import threading
import time

import numpy as np
import pytest
import zmq

from vconsole.engine.latency import LatencyLog, LatencyStats
from vconsole.engine.publish.bodies import KVFormat
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, RequestRow, SchedulerStats, StepStats
from vconsole.telemetry.schema import DP_TOPICS, TOPICS, decode, missing_fields

FAST = dict(telemetry_hz=20.0, heartbeat_interval_s=0.1, config_interval_s=0.3)



@pytest.fixture(params=["thread", "process"])
def make_pub(ctx, request):
    pubs = []

    def make(kv_format=None, **cfg):
        pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-7", 2,
                                 EngineConfig(**{**FAST, **cfg}), kv_format=kv_format,
                                 process=request.param == "process")
        pub.start()
        pubs.append(pub)
        return pub

    yield make
    for p in pubs:
        p.close()
    assert all(p.error is None for p in pubs)


def subscribe(ctx, pub, topics=(b"",), hwm=None):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        sub.setsockopt(zmq.RCVHWM, hwm)
    for t in topics:
        sub.subscribe(t)
    sub.connect(pub.endpoint)
    return sub


def collect(sub, seconds, until=None):
    out, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if sub.poll(int(left * 1000) + 1):
            out.append(decode(sub.recv_multipart(copy=False)))
            if until is not None and until(out):
                break
    return out


def wait_connected(sub):
    """Past the slow-joiner window: the first heartbeat has arrived."""
    assert collect(sub, 3, until=lambda ms: any(m.topic == "health" for m in ms))


def step(i=0):
    return StepStats(schedule_ns=100_000, execute_ns=8_000_000, update_ns=400_000,
                     total_ns=9_000_000 + i * 1000, num_prefill_tokens=32,
                     num_decode_tokens=4, num_reqs=5)


def snapshot(num_waiting=3, n_rows=3, num_blocks=64):
    rows = [RequestRow(f"req-{i}", "running", i, 20 + i, i, 2, 0.5 * i) for i in range(n_rows)]
    states = np.zeros(num_blocks, np.uint8)
    states[:10], states[10:12], states[12:15] = 1, 3, 2
    sched = SchedulerStats(num_waiting=num_waiting, num_running=n_rows, num_preempted=1,
                           num_preemptions_total=4, max_num_seqs=64, max_num_batched_tokens=512,
                           policy="priority", num_finished_total=17, requests=rows)
    kv = KVStats(num_blocks=num_blocks, block_size=16, num_free=num_blocks - 15, num_used=12,
                 num_cached=3, num_shared=2, usage=12 / num_blocks, token_usage=0.1,
                 fragmentation=0.25, prefix_queries=400, prefix_hits=100, block_states=states)
    return sched, kv


def test_a_subscriber_gets_every_topic_with_the_submitted_numbers(ctx, make_pub):
    pub = make_pub()
    sub = subscribe(ctx, pub)
    wait_connected(sub)
    pub.publish_config(5, {"max_num_seqs": 64, "policy": "priority"})
    for i in range(40):
        pub.record_step(step(i))
    sched, kv = snapshot(num_waiting=60)  # over alert_waiting_warning (50)
    pub.submit_snapshot(sched, kv, "running", 40)
    lat = LatencyLog()
    lat.observe("ttft_s", 0.3, priority=0, now=5.0)
    pub.submit_latency(lat.drain(5.0, 60.0))
    lone = set(TOPICS) - set(DP_TOPICS)   # a lone engine sends every topic but the DP ones
    msgs = collect(sub, 3, until=lambda ms: {m.topic for m in ms} == lone
                   and sum(m.payload["steps"] for m in ms if m.topic == "step") >= 40)
    by_topic = {t: [m for m in msgs if m.topic == t] for t in sorted(lone)}
    assert all(by_topic.values()), {t: len(v) for t, v in by_topic.items()}
    for t, ms in by_topic.items():
        seqs = [m.seq for m in ms]
        assert seqs == sorted(set(seqs)), t
        assert all(m.engine == "engine-7" and m.rank == 2 for m in ms)
        assert missing_fields(t, ms[-1].payload) == [], t

    steps = [m.payload for m in by_topic["step"] if m.payload["steps"]]
    assert sum(m["steps"] for m in steps) == 40
    # Every step is counted once, whether one message carries the 40 or a stall of this
    # process between two record_step calls let the publisher send the first ones alone.
    assert sum(m["num_prefill_tokens"] for m in steps) == 40 * 32
    assert sum(m["num_decode_tokens"] for m in steps) == 40 * 4
    assert sum(m["phase_s"]["execute"] for m in steps) == pytest.approx(40 * 0.008)
    assert max(m["step_time_max_s"] for m in steps) == pytest.approx(0.009039)
    full = next((m for m in steps if m["steps"] == 40), None)
    if full is not None:     # the window's own figures, over all 40
        assert full["step_time_p50_s"] == pytest.approx(0.0090195)
        assert full["sched_share"] == pytest.approx(40 * 100_000 / sum(9_000_000 + i * 1000
                                                                       for i in range(40)))
        assert full["tokens_per_s"] == pytest.approx(40 * 36 / full["window_s"])

    s = by_topic["sched"][0].payload
    assert (s["num_waiting"], s["num_running"], s["policy"], s["num_finished_total"]) == \
        (60, 3, "priority", 17)
    assert s["requests"][2] == {"id": "req-2", "state": "running", "priority": 2,
                                "num_prompt_tokens": 22, "num_output_tokens": 2,
                                "num_blocks": 2, "age_s": 1.0, "constraint": 0,
                                "compile_ms": 0.0}
    k = by_topic["kv"][0]
    assert k.payload["num_used"] == 12 and k.payload["prefix_hit_rate"] == 0.25
    np.testing.assert_array_equal(k.block_states(), kv.block_states)

    alert = by_topic["alert"][0].payload
    assert (alert["name"], alert["level"], alert["value"]) == ("waiting", "warning", 60)
    assert any(m.payload["alerts_active"] == {"waiting": "warning"} for m in by_topic["health"])
    cfg = by_topic["config"][-1].payload
    assert cfg["version"] == 5 and cfg["values"]["policy"] == "priority"
    assert any(r["key"] == "telemetry_hz" and r["hot"] for r in cfg["schema"])
    assert by_topic["host"][0].payload["proc_rss_bytes"] > 0
    assert "available" in by_topic["gpu"][0].payload
    assert by_topic["health"][-1].payload["state"] == "running"
    assert by_topic["health"][-1].payload["steps"] == 40
    sub.close()


def test_latency_is_aggregated_by_the_publisher_from_the_engines_batches(ctx, make_pub):
    """The busy loop hands raw observations (`LatencyLog.drain`); the publisher (thread or
    process) keeps the histograms and windows: two batches publish what one `LatencyStats`
    that saw every observation publishes."""
    pub = make_pub()
    sub = subscribe(ctx, pub)
    wait_connected(sub)
    log, whole = LatencyLog(), LatencyStats(60.0)
    for name, value, prio, now in (("ttft_s", 0.3, 0, 5.0), ("itl_s", 0.02, 2, 5.0),
                                   ("ttft_s", 0.9, 2, 5.5)):
        log.observe(name, value, prio, now)
        whole.observe(name, value, prio, now)
    log.finish("stop")
    whole.finish("stop")
    pub.submit_latency(log.drain(6.0, 60.0))
    assert collect(sub, 3, until=lambda ms: any(m.topic == "latency" for m in ms))
    log.observe_many("itl_s", [0.01, 0.05, 0.2], [0, 0, 2], 7.0)
    whole.observe_many("itl_s", [0.01, 0.05, 0.2], [0, 0, 2], 7.0)
    log.finish("length")
    whole.finish("length")
    pub.submit_latency(log.drain(8.0, 60.0))
    msgs = collect(sub, 3, until=lambda ms: any(
        m.topic == "latency" and m.payload["finished"] == {"stop": 1, "length": 1} for m in ms))
    body = next(m.payload for m in msgs if m.topic == "latency"
                and m.payload["finished"] == {"stop": 1, "length": 1})
    expected = whole.snapshot(8.0)
    assert body["overall"]["histograms"]["itl_s"]["count"] == 4
    assert body["overall"] == expected["overall"]
    assert body["priority"] == expected["priority"]


@pytest.mark.parametrize("kv_format", [KVFormat("int4_per_token_head", 320), None],
                         ids=["known", "unknown"])
def test_every_kv_message_says_how_the_pool_stores_tokens(ctx, make_pub, kv_format):
    pub = make_pub(kv_format=kv_format)
    sub = subscribe(ctx, pub, topics=(b"health", b"kv"))
    wait_connected(sub)
    sched, kv = snapshot(num_blocks=64)
    pub.submit_snapshot(sched, kv, "running", 1)
    first = next(m.payload for m in collect(sub, 3, until=lambda ms: any(
        m.topic == "kv" for m in ms)) if m.topic == "kv")
    assert first["capacity_tokens"] == 64 * 16       # blocks x block size, known or not
    if kv_format is None:                             # a core that does not say: null, not made up
        assert (first["cache_dtype"], first["bytes_per_token"], first["pool_bytes"]) == (
            None, None, None)
    else:
        assert (first["cache_dtype"], first["bytes_per_token"], first["pool_bytes"]) == (
            "int4_per_token_head", 320, 64 * 16 * 320)
    # the heartbeat re-send of an idle engine carries them too
    again = [m.payload for m in collect(sub, 0.5) if m.topic == "kv"]
    assert again and all(p["cache_dtype"] == first["cache_dtype"] for p in again)
    sub.close()


def test_snapshots_are_rate_limited_to_telemetry_hz(ctx, make_pub):
    pub = make_pub(telemetry_hz=10.0, heartbeat_interval_s=1.0)
    sub = subscribe(ctx, pub, topics=(b"kv", b"health"))
    wait_connected(sub)
    sched, kv = snapshot()
    stop = threading.Event()
    dues = []

    def engine_loop():  # submits far faster than 10 Hz, ignoring snapshot_due
        while not stop.is_set():
            pub.record_step(step())
            dues.append(pub.snapshot_due())
            pub.submit_snapshot(sched, kv, "running", 0)
            time.sleep(0.001)

    t = threading.Thread(target=engine_loop)
    t.start()
    try:
        msgs = collect(sub, 1.5)
    finally:
        stop.set()
        t.join()
    sent = sorted(m.ts for m in msgs if m.topic == "kv")
    busiest = max(sum(1 for x in sent if a <= x <= a + 1.0) for a in sent)
    assert 7 <= busiest <= 12, sent
    assert sum(dues) <= 17  # ~1.5 s of calls at 10 Hz
    sub.close()


def test_health_keeps_coming_while_nothing_is_submitted(ctx, make_pub):
    pub = make_pub()
    sub = subscribe(ctx, pub)
    wait_connected(sub)
    msgs = collect(sub, 0.65)
    health = [m for m in msgs if m.topic == "health"]
    assert len(health) >= 4
    assert all(m.payload["state"] == "idle" and m.payload["steps"] == 0 for m in health)
    assert [m.seq for m in health] == list(range(health[0].seq, health[0].seq + len(health)))
    assert not [m for m in msgs if m.topic in ("step", "sched", "kv")]  # nothing to report
    sub.close()


def test_an_engine_that_stepped_since_the_last_heartbeat_is_running_though_idle_now(
        ctx, make_pub):
    # Light load: each heartbeat finds the engine between two requests ("idle" at that
    # instant), yet it stepped in between; health says running until it stops stepping.
    pub = make_pub()
    sub = subscribe(ctx, pub, topics=(b"health",))
    wait_connected(sub)
    stop = threading.Event()

    def engine_loop() -> None:
        while not stop.is_set():
            pub.set_state("running")
            pub.record_step(StepStats(1_000, 500_000, 1_000, 502_000, 4, 0, 1))
            pub.set_state("idle")
            time.sleep(0.01)

    t = threading.Thread(target=engine_loop)
    t.start()
    try:
        # Past the health in flight when the steps began: the first one that counts a step.
        drained = collect(sub, 5, until=lambda ms: ms[-1].payload["steps"] > 0)
        assert drained and drained[-1].payload["steps"] > 0
        busy = [m.payload["state"] for m in collect(sub, 0.5)]
    finally:
        stop.set()
        t.join()
    quiet = [m.payload["state"] for m in collect(sub, 0.5)]
    assert len(busy) >= 3 and set(busy) == {"running"}, busy
    # The heartbeats after the last step may still count it (one, or two where the steps'
    # hand-off to the publisher process was late on a loaded machine); from then on, idle for
    # good: never running again after an idle one.
    first_idle = quiet.index("idle") if "idle" in quiet else len(quiet)
    assert quiet[-3:] == ["idle"] * 3 and "running" not in quiet[first_idle:], quiet
    sub.close()


def test_last_state_is_refreshed_for_a_late_subscriber(ctx, make_pub):
    pub = make_pub()
    sched, kv = snapshot(num_waiting=7)
    pub.submit_snapshot(sched, kv, "idle", 0)
    time.sleep(0.3)     # a fixed wait on purpose: the snapshot ages before anyone subscribes
    sub = subscribe(ctx, pub, topics=(b"sched", b"config", b"step"))
    msgs = collect(sub, 2, until=lambda ms: {"sched", "config", "step"} <= {m.topic for m in ms})
    late = {m.topic: m.payload for m in msgs}
    assert late["sched"]["num_waiting"] == 7 and late["sched"]["snapshot_ts"] < time.time() - 0.2
    assert late["step"]["steps"] == 0 and late["config"]["version"] == 0
    sub.close()


def test_engine_side_calls_never_wait_on_subscribers(ctx, make_pub):
    """A subscriber that is connected and never reads, with one-message queues on both sides:
    an engine-side call that waited on it would wait forever. 20,000 steps and 200 snapshots
    of 2,000 rows end within a bound of seconds (no timing of the calls themselves: a loaded
    machine stalls a process now and then), and the publisher still serves others."""
    pub = make_pub(zmq_sndhwm=1, telemetry_hz=100.0)
    stuck = subscribe(ctx, pub, hwm=1)  # connected, never reads
    assert collect(stuck, 3, until=lambda ms: len(ms) >= 1)   # its queue is full from here
    sched, kv = snapshot(n_rows=2000, num_blocks=1 << 20)
    failed: list[BaseException] = []

    def engine_side() -> None:
        try:
            for i in range(20_000):
                pub.record_step(step())
                if i % 100 == 0:
                    pub.submit_snapshot(sched, kv, "running", i)
        except BaseException as e:
            failed.append(e)

    caller = threading.Thread(target=engine_side, daemon=True)
    caller.start()
    caller.join(60.0)
    assert not caller.is_alive(), "an engine-side call is waiting on the stuck subscriber"
    assert not failed, failed
    # The publisher side is not wedged either: a fresh subscriber gets heartbeats and the last
    # step count, although the stuck one still holds its full queue.
    fresh = subscribe(ctx, pub, topics=(b"health",))
    got = collect(fresh, 5, until=lambda ms: any(m.payload["steps"] == 20_000 for m in ms))
    assert any(m.payload["steps"] == 20_000 for m in got), [m.payload["steps"] for m in got]
    stuck.close()
    fresh.close()


def test_record_step_with_nobody_listening_never_waits(make_pub):
    """With nobody listening, 50,000 steps end within a bound of seconds (a list append and a
    16-byte write each; a wait on a missing subscriber would never end) and are all counted."""
    pub = make_pub()
    s = step()
    caller = threading.Thread(target=lambda: [pub.record_step(s) for _ in range(50_000)],
                              daemon=True)
    caller.start()
    caller.join(60.0)
    assert not caller.is_alive()
    assert pub.steps_recorded == 50_000


def test_hot_config_update_changes_row_cap_and_thresholds(ctx, make_pub):
    pub = make_pub()
    sub = subscribe(ctx, pub, topics=(b"sched", b"alert", b"health"))
    wait_connected(sub)
    pub.update_config(EngineConfig(**FAST, telemetry_max_requests=2, alert_waiting_warning=5,
                                   alert_waiting_critical=6))
    sched, kv = snapshot(num_waiting=5, n_rows=4)
    pub.submit_snapshot(sched, kv, "running", 0)
    msgs = collect(sub, 2, until=lambda ms: {"sched", "alert"} <= {m.topic for m in ms})
    s = next(m.payload for m in msgs if m.topic == "sched")
    assert [r["id"] for r in s["requests"]] == ["req-0", "req-1"] and s["requests_truncated"]
    a = next(m.payload for m in msgs if m.topic == "alert")
    assert (a["name"], a["level"], a["threshold"]) == ("waiting", "warning", 5)
    pub.update_config(EngineConfig(**FAST))  # back to 50: the same reading recovers
    msgs = collect(sub, 2, until=lambda ms: any(m.topic == "alert" for m in ms))
    a = next(m.payload for m in msgs if m.topic == "alert")
    assert (a["name"], a["level"]) == ("waiting", "ok")
    sub.close()


def test_start_reports_a_bind_failure(ctx, make_pub):
    pub = make_pub()
    other = TelemetryPublisher(ctx, pub.endpoint, "engine-8", 0, EngineConfig())
    with pytest.raises(zmq.ZMQError):
        other.start()


def test_slow_steps_alert_and_recover_once_the_engine_is_idle(ctx, make_pub):
    # Short window and holds (the defaults: 5 s, 2 s, 20 s; tests/telemetry/test_alerts_step_window.py)
    pub = make_pub(alert_step_time_window_s=0.5, alert_step_time_raise_s=0.0,
                   alert_step_time_clear_s=0.3)
    sub = subscribe(ctx, pub, topics=(b"alert", b"health"))
    wait_connected(sub)
    pub.set_state("running")
    for _ in range(3):
        pub.record_step(StepStats(1_000_000, 600_000_000, 1_000_000, 602_000_000, 0, 8, 8))
    msgs = collect(sub, 2, until=lambda ms: any(m.topic == "alert" for m in ms))
    alerts = [m.payload for m in msgs if m.topic == "alert"]
    assert [(a["name"], a["level"]) for a in alerts] == [("step_time", "warning")]
    assert alerts[0]["value"] == pytest.approx(0.602)
    # Running but no further steps: maybe stuck, so the warning holds.
    msgs = collect(sub, 0.4)
    assert not [m for m in msgs if m.topic == "alert"]
    health = [m.payload for m in msgs if m.topic == "health"]
    assert health[-1]["alerts_active"] == {"step_time": "warning"}
    assert health[-1]["last_step_age_s"] > 0.2
    pub.set_state("idle")
    msgs = collect(sub, 2, until=lambda ms: any(m.topic == "alert" for m in ms))
    alerts = [m.payload for m in msgs if m.topic == "alert"]
    assert [(a["name"], a["level"]) for a in alerts] == [("step_time", "ok")]
    assert not [m for m in collect(sub, 0.3) if m.topic == "alert"]  # recovers once
    sub.close()
