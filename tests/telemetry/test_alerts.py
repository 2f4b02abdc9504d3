"""AlertEvaluator: edge-triggered level changes against config thresholds, hot-updatable."""

from vconsole.shared.config import EngineConfig
from vconsole.telemetry.alerts import RULES, AlertEvaluator


def levels(events):
    return [(e.name, e.previous, e.level) for e in events]


def test_step_time_crossings_fire_once_each_and_recover_once():
    # No hold and a window of one snapshot: each reading stands alone (the step window's own
    # behaviour is tests/telemetry/test_alerts_step_window.py).
    ev = AlertEvaluator(EngineConfig(alert_step_time_window_s=0.1, alert_step_time_raise_s=0,
                                     alert_step_time_clear_s=0))   # 0.5 s warning, 1 s critical
    t = iter(range(100))

    def steps(p50):
        return ev.observe_steps(float(next(t)), p50, 3)
    assert steps(0.1) == []
    up = steps(0.6)
    assert levels(up) == [("step_time", "ok", "warning")]
    assert up[0].threshold == 0.5 and up[0].value == 0.6 and "600 ms" in up[0].message
    assert steps(0.7) == []                                  # still warning: no repeat
    assert levels(steps(1.0)) == [("step_time", "warning", "critical")]
    assert steps(3.0) == []
    assert levels(steps(0.8)) == [("step_time", "critical", "warning")]
    down = steps(0.01)
    assert levels(down) == [("step_time", "warning", "ok")] and down[0].threshold == 0.5
    assert steps(0.01) == [] and ev.active() == {}


def test_jump_from_ok_straight_to_critical_and_back():
    ev = AlertEvaluator(EngineConfig())
    assert levels(ev.observe(num_waiting=150)) == [("waiting", "ok", "critical")]
    assert ev.active() == {"waiting": "critical"}
    assert levels(ev.observe(num_waiting=0)) == [("waiting", "critical", "ok")]


def test_warning_only_figures_and_several_at_once():
    ev = AlertEvaluator(EngineConfig(fragmentation_threshold=0.4))
    out = ev.observe(sched_share=0.99, fragmentation=0.9, gpu_memory_share=0.96,
                     num_waiting=10)
    assert levels(out) == [("gpu_memory", "ok", "critical"), ("sched_share", "ok", "warning"),
                           ("fragmentation", "ok", "warning")]
    assert ev.levels["sched_share"] == "warning"  # no critical level for it
    assert ev.observe(sched_share=0.99, fragmentation=0.9) == []


def test_missing_readings_keep_the_level():
    ev = AlertEvaluator(EngineConfig())
    ev.observe(gpu_memory_share=0.9)
    assert ev.observe() == [] and ev.observe(gpu_memory_share=None) == []
    assert ev.active() == {"gpu_memory": "warning"}


def test_hot_threshold_change_rejudges_the_last_readings():
    ev = AlertEvaluator(EngineConfig())
    assert ev.observe(num_waiting=30) == []
    out = ev.update_config(EngineConfig(alert_waiting_warning=20, alert_waiting_critical=25))
    assert levels(out) == [("waiting", "ok", "critical")] and out[0].threshold == 25
    out = ev.update_config(EngineConfig())
    assert levels(out) == [("waiting", "critical", "ok")]
    assert ev.observe(num_waiting=30) == []


def test_payload_is_the_alert_topic_body():
    ev = AlertEvaluator(EngineConfig())
    (e,) = ev.observe(num_waiting=55)
    body = e.payload()
    assert {"name", "level", "value", "threshold", "message"} <= set(body)
    assert body["level"] == "warning" and body["message"].startswith("waiting requests is 55")
    assert set(RULES) == {"step_time", "waiting", "gpu_memory", "sched_share", "fragmentation"}
