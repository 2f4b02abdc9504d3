"""The console's data model and pure helpers, fed with frames from the real schema encoder."""

from __future__ import annotations

import numpy as np
import pytest

from support.console_testing import FakeControl, foreign_version_frames, frames
from support.synthetic import generate
from vconsole.console import format as fmt
from vconsole.console.changes import (
    APPLIED,
    REJECTED,
    RESTART,
    ChangeRecord,
    consequence,
    validate,
)
from vconsole.console.engine_state import Series
from vconsole.console.requests_view import filter_rows, not_understood, sort_rows
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.kv_grid import fit_blocks_per_cell, summarise

T = 1_700_000_000.0


def health(seq: int, ts: float, interval: float = 1.0, **kw: object) -> list[object]:
    body = {"state": "running", "uptime_s": 10.0 + seq, "steps": seq * 10, "interval_s": interval,
            **kw}
    return frames("health", body, seq=seq, ts=ts)


def kv_body(states: np.ndarray) -> dict[str, object]:
    counts = np.bincount(states, minlength=4)
    return {"num_blocks": len(states), "block_size": 16, "num_free": int(counts[0]),
            "num_used": int(counts[1] + counts[3]), "num_cached": int(counts[2]),
            "num_shared": int(counts[3]), "usage": 0.5, "token_usage": 0.4,
            "fragmentation": 0.1, "prefix_queries": 100, "prefix_hits": 25,
            "prefix_hit_rate": 0.25, "block_states": states}


def test_latest_payload_per_topic_and_engine():
    s = ConsoleState(clock=lambda: T)
    s.ingest(health(0, T), T)
    s.ingest(frames("health", {"state": "idle", "uptime_s": 1.0, "steps": 0, "interval_s": 1.0},
                    engine="tiny-1", rank=1), T)
    assert [e.key for e in s.engine_list()] == ["tiny-0/0", "tiny-1/1"]
    assert s.engine().latest["health"]["state"] == "running"
    assert s.engine("tiny-1/1").latest["health"]["state"] == "idle"


def test_seq_gaps_count_drops_and_a_reset_counts_a_restart():
    s = ConsoleState(clock=lambda: T)
    for seq in (0, 1, 2, 5, 6):
        s.ingest(health(seq, T + seq), T + seq)
    eng = s.engine()
    assert eng.dropped == 2
    s.ingest(health(0, T + 10), T + 10)   # publisher restarted: not a loss
    assert eng.dropped == 2
    assert eng.restarts == 1


def test_a_restart_heard_first_at_a_higher_seq_is_still_a_restart():
    # A subscriber that reconnects late may first hear the new engine at a seq above the old
    # engine's last (and at an uptime above it): another pid and start time say it is another
    # process, so a config it announces at version 1 replaces the old engine's version 2.
    s = ConsoleState(clock=lambda: T)
    for seq in (0, 1, 2):
        s.ingest(health(seq, T + seq, pid=100, started_ts=T - 5), T + seq)
    s.ingest(frames("config", {"values": {"max_num_seqs": 7}, "version": 2, "schema": []},
                    seq=0, ts=T + 2), T + 2)
    eng = s.engine()
    s.ingest(health(9, T + 9, pid=200, started_ts=T + 1), T + 9)   # uptime 19 s > 12 s
    assert eng.restarts == 1 and eng.dropped == 0
    s.ingest(frames("config", {"values": {"max_num_seqs": 6}, "version": 1, "schema": []},
                    seq=4, ts=T + 9), T + 9)
    assert (s.config.version, s.config.values["max_num_seqs"]) == (1, 6)
    s.ingest(health(10, T + 10, pid=200, started_ts=T + 1), T + 10)   # the same process
    assert eng.restarts == 1


def test_heartbeat_stale_after_three_intervals():
    now = [T]
    s = ConsoleState(clock=lambda: now[0])
    s.ingest(health(0, T, interval=0.5), T)
    eng = s.engine()
    now[0] = T + 1.4
    assert eng.status(now[0]) == "running"
    now[0] = T + 1.6
    assert eng.status(now[0]) == "down"
    assert [e.key for e in s.mark_down()] == ["tiny-0/0"]
    s.ingest(health(1, T + 2, interval=0.5), now[0])
    assert eng.status(now[0]) == "running"
    assert eng.reconnects == 1


def test_kv_block_states_are_kept_as_an_array():
    states = np.array([0, 1, 1, 2, 3, 0], dtype=np.uint8)
    s = ConsoleState(clock=lambda: T)
    s.ingest(frames("kv", kv_body(states)), T)
    assert s.engine().block_states.tolist() == states.tolist()
    assert s.engine().series["kv_usage"].last == 0.5


def test_schema_version_mismatch_is_a_message_not_an_exception():
    s = ConsoleState(clock=lambda: T)
    assert s.ingest(foreign_version_frames(), T) is None
    problem = s.schema_problem(T)
    assert problem is not None and "version 99" in problem and "version 1" in problem
    assert s.schema_problem(T + 60) is None  # the mismatched publisher went away


def test_malformed_message_is_counted():
    s = ConsoleState(clock=lambda: T)
    assert s.ingest([b"health", b"\xc1not msgpack"], T) is None
    assert s.malformed == 1 and "msgpack" in (s.last_error or "")


def test_a_payload_of_the_wrong_shape_is_counted_and_the_next_one_still_lands():
    s = ConsoleState(clock=lambda: T)
    assert s.ingest(frames("gpu", {"available": True, "devices": ["not a dict"]}), T) is None
    assert s.malformed == 1 and "gpu" in (s.last_error or "")
    good = frames("health", {"state": "idle", "uptime_s": 1.0, "steps": 0, "interval_s": 1.0})
    assert s.ingest(good, T) is not None


def test_alerts_history_and_active_set():
    s = ConsoleState(clock=lambda: T)
    alert = {"name": "waiting", "level": "warning", "value": 60.0, "threshold": 50.0,
             "message": "waiting requests is 60"}
    s.ingest(frames("alert", alert, seq=0), T)
    assert list(s.active_alerts) == [("tiny-0/0", "waiting")]
    s.ingest(frames("alert", {**alert, "level": "ok"}, seq=1), T + 1)
    assert not s.active_alerts
    assert [a.level for a in s.latest_alerts(5)] == ["ok", "warning"]


def test_each_engine_restart_is_listed_once_from_its_event_or_from_health():
    """The supervisor's ``engine_restart`` event repeats with every restarting beat, the new
    engine's health carries the count: the Alerts list shows each restart once, with time and
    reason, and none stays "active"."""
    from vconsole.telemetry.alerts import restart_event

    s = ConsoleState(clock=lambda: T)
    s.ingest(health(0, T, restart_count=0), T)
    event = restart_event(1, "killed by SIGKILL", back=False).payload()
    for seq in range(3):
        s.ingest(frames("alert", event, seq=seq), T + 1 + seq)
    s.ingest(health(1, T + 5, restart_count=1, restart_reason="killed by SIGKILL"), T + 5)
    s.ingest(frames("alert", restart_event(1, "killed by SIGKILL", back=True).payload(),
                    seq=3), T + 6)
    restarts = [a for a in s.latest_alerts(20) if a.name == "engine_restart"]
    assert [(a.recv_ts, a.value) for a in restarts] == [(T + 1, 1.0)]
    assert "killed by SIGKILL" in restarts[0].message
    # A second restart whose event was lost still shows, from health.
    s.ingest(health(2, T + 30, restart_count=2, restart_reason="hung: no step for 61 s"),
             T + 30)
    restarts = [a for a in s.latest_alerts(20) if a.name == "engine_restart"]
    assert [a.value for a in restarts] == [2, 1.0]
    assert restarts[0].message == "engine restarted (2): hung: no step for 61 s"
    assert not s.active_alerts


def test_a_restart_heard_late_is_dated_when_the_new_process_started():
    """A console attached minutes after a restart learns of it from health's count: the line
    is dated by the new process's uptime, not by the moment this console first heard, and two
    restarts minutes apart are not counted as flapping within a minute."""
    s = ConsoleState(clock=lambda: T)
    s.ingest(health(0, T, uptime_s=150.0, restart_count=1, restart_reason="killed by SIGKILL"),
             T)
    (first,) = [a for a in s.latest_alerts(5) if a.name == "engine_restart"]
    assert first.recv_ts == pytest.approx(T - 150.0)
    s.ingest(health(1, T + 20, uptime_s=2.0, restart_count=2, restart_reason="killed by SIGKILL"),
             T + 20)
    assert [(a.value, a.recv_ts, n) for a, n in s.alert_summary(T + 20)] == [(2, T + 18, 1)]


def test_the_summary_line_of_a_down_engine_shows_no_uptime_or_rates():
    from vconsole.console.widgets import panels

    s = ConsoleState(clock=lambda: T)
    s.ingest(health(0, T, interval=1.0), T)
    s.ingest(frames("step", {"steps_per_s": 14.4, "tokens_per_s": 86.0}, seq=1), T)
    eng = s.engine()
    live = panels.summary(eng, T + 0.5)
    assert "14.4" in live and "86" in live and "up 10.0s" in live
    down = panels.summary(eng, T + 10)
    assert eng.status(T + 10) == "down"
    assert "14.4" not in down and "86" not in down and "up –" in down
    assert "– steps/s" in down.replace("[b]", "").replace("[/]", "")


def test_config_from_control_and_telemetry_newest_wins_but_no_rollback():
    ctl = FakeControl()
    s = ConsoleState(clock=lambda: T)
    s.set_config_reply(ctl.get_config(), T)
    assert s.config.origin == "control" and s.config.values["max_num_seqs"] == 32
    reply = ctl.set_config({"max_num_seqs": 16})
    s.set_config_reply(reply, T + 1)
    assert s.config.version == 2
    # A config announcement built before the change, delivered after it, must not undo it.
    old = {"version": 1, "values": {**s.config.values, "max_num_seqs": 32}, "schema": []}
    s.ingest(frames("config", old, seq=0, ts=T), T + 2)
    assert s.config.values["max_num_seqs"] == 16


def test_series_resample_buckets_the_window():
    ser = Series(capacity=8)
    for i in range(12):       # wraps the ring
        ser.append(T + i, float(i))
    assert len(ser) == 8      # samples 0..3 fell out of the ring
    assert ser.resample(T + 12, 12, 6) == [None, None, 4.5, 6.5, 8.5, 10.5]
    # Buckets without samples carry the previous value; older samples seed the first bucket.
    assert ser.resample(T + 40, 20, 4) == [11.0, 11.0, 11.0, 11.0]


def test_synthetic_recording_is_coherent():
    recs = list(generate(duration_s=5, seed=1))
    s = ConsoleState(clock=lambda: recs[-1][0])
    s.feed(recs)
    eng = s.engine()
    assert eng.dropped == 0 and s.malformed == 0
    sc = eng.latest["sched"]
    assert sc["num_running"] <= sc["max_num_seqs"]
    assert len(sc["requests"]) == sc["num_waiting"] + sc["num_running"]
    kv = eng.latest["kv"]
    assert int(eng.block_states.size) == kv["num_blocks"]
    assert kv["num_free"] + kv["num_used"] + kv["num_cached"] - kv["num_shared"] <= \
        kv["num_blocks"]


# --- pure helpers ---------------------------------------------------------------------------

ROWS = [{"id": "req-1", "state": "running", "priority": 0, "num_prompt_tokens": 10,
         "num_output_tokens": 5, "num_blocks": 1, "age_s": 3.0},
        {"id": "req-2", "state": "waiting", "priority": 5, "num_prompt_tokens": 100,
         "num_output_tokens": 0, "num_blocks": 0, "age_s": 9.0},
        {"id": "req-3", "state": "preempted", "priority": 1, "num_prompt_tokens": 50,
         "num_output_tokens": 7, "num_blocks": 0, "age_s": 1.0}]


@pytest.mark.parametrize("query, ids", [
    ("", ["req-1", "req-2", "req-3"]), ("running", ["req-1"]), ("prio>0", ["req-2", "req-3"]),
    ("state:wait", ["req-2"]), ("age>=3 prio<5", ["req-1"]), ("REQ-3", ["req-3"]),
    # A comparison that is not one is ignored (and named by not_understood), not searched for.
    ("prio>abc", ["req-1", "req-2", "req-3"]), ("prio>>x running", ["req-1"]),
])
def test_filter_rows(query, ids):
    assert [r["id"] for r in filter_rows(ROWS, query)] == ids


@pytest.mark.parametrize("query, bad", [
    ("prio>>x", ["prio>>x"]), ("age>soon running", ["age>soon"]), ("state>3", ["state>3"]),
    ("foo>1", ["foo>1"]), ("prio>0 age>=3 output=0 blocks!=1", []), ("state:run req-1", []),
    ("id:a>b", []),
])
def test_not_understood_names_the_comparisons_that_are_not_one(query, bad):
    assert not_understood(query) == bad


def test_sort_rows_numeric_and_text():
    assert [r["id"] for r in sort_rows(ROWS, "age_s", reverse=True)] == ["req-2", "req-1",
                                                                          "req-3"]
    assert [r["id"] for r in sort_rows(ROWS, "state")] == ["req-3", "req-1", "req-2"]


def test_kv_summary_of_runs_shows_the_mix():
    states = np.array([0, 0, 0, 0, 1, 1, 2, 0, 3, 3, 3, 3], dtype=np.uint8)
    glyph, dom = summarise(states, 4)
    assert glyph.tolist() == [0, 3, 4]   # all free, 3 of 4 busy, all busy
    assert dom.tolist() == [0, 1, 3]
    assert fit_blocks_per_cell(1_000_000, 70 * 18) == 1024


def test_format_helpers():
    assert fmt.sparkline([0, 5, 10, None], 0, 10) == "▁▅█ "
    assert fmt.duration(3723) == "1h02m" and fmt.duration(0.25) == "250ms"
    assert fmt.bar(0.5, 4) == "██░░"
    assert fmt.level(0.85, 0.8, 0.95) == "warning" and fmt.level(0.96, 0.8, 0.95) == "critical"
    assert fmt.nbytes_pair(3 * 2**30, 8 * 2**30) == "3.0/8.0GiB"
    assert fmt.fit(["aaaa", "bbbb", "cccc"], 11) == "aaaa · bbbb"


def test_validate_and_consequences():
    assert validate("max_num_seqs", "8") == (8, None)
    value, reason = validate("max_num_seqs", "lots")
    assert value is None and "integer" in reason
    assert "none is preempted" in consequence("max_num_seqs", 64, 8, num_running=40)
    assert consequence("max_num_seqs", 64, 60, num_running=10) is None
    assert consequence("block_size", 16, 32, hot=False) is None
    assert consequence("enable_prefix_caching", True, False) is not None


def test_change_record_reads_engine_replies():
    ctl = FakeControl()
    rec = ChangeRecord("max_num_seqs", 32, 16)
    rec.take_reply(ctl.set_config({"max_num_seqs": 16}))
    assert rec.status == APPLIED and rec.version == 2
    rec = ChangeRecord("block_size", 16, 32)
    rec.take_reply(ctl.set_config({"block_size": 32}))
    assert rec.status == RESTART
    rec = ChangeRecord("max_num_seqs", 16, 10**9)
    rec.take_reply(ctl.set_config({"max_num_seqs": 10**9}))
    assert rec.status == REJECTED and "<=" in rec.reason


def test_what_the_dialog_says_of_lowering_max_num_seqs_is_what_the_scheduler_does():
    """16 -> 4 with 12 running: the dialog says they drain and none is preempted; a real
    scheduler then keeps all 12 running and admits nobody until they are under 4."""
    from support.scheduling import make_request, make_scheduler
    from vconsole.engine.sched.output import ModelRunnerOutput

    s = make_scheduler(num_blocks=256, max_num_seqs=16)
    for i in range(12):
        s.add_request(make_request(f"r{i}", 4, max_tokens=6 + i))

    def step() -> None:
        so = s.schedule()
        s.update_from_output(so, ModelRunnerOutput({r: 7 for r in so.num_scheduled_tokens}))

    step()
    for i in range(12, 20):
        s.add_request(make_request(f"r{i}", 4, max_tokens=40))
    assert len(s.running) == 12
    said = consequence("max_num_seqs", 16, 4, num_running=12)
    assert "until the 12 running ones drain to 4" in said and "none is preempted" in said
    s.update_config(s.config.__class__(**{**s.config.to_dict(), "max_num_seqs": 4}))
    seen = []
    while len(s.running) > 4:
        step()
        seen.append(len(s.running))
    assert s.num_preemptions_total == 0
    assert seen == sorted(seen, reverse=True), "drains, never admits on the way down"


def test_request_ids_sort_as_a_person_reads_them():
    from vconsole.console.requests_view import select
    from vconsole.telemetry.request_columns import RequestColumns

    ids = ["1:c-132", "1:c-18", "1:c-2", "0:b-7", "1:c-18a"]
    rows = [{"id": i, "state": "waiting", "priority": 0} for i in ids]
    want = ["0:b-7", "1:c-2", "1:c-18", "1:c-18a", "1:c-132"]
    assert [r["id"] for r in sort_rows(rows, "id")] == want
    assert [r["id"] for r in sort_rows(rows, "id", reverse=True)] == want[::-1]
    cols = RequestColumns.from_rows(rows)        # the columnar path the screen uses
    assert [ids[i] for i in select(cols, "", "id")] == want
    assert [ids[i] for i in select(cols, "", "id", reverse=True)] == want[::-1]
