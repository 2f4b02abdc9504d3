"""Alert hysteresis: a level is left only once the value falls ``alert_hysteresis`` below its
threshold, so a figure hovering on a threshold raises once and clears once."""

import pytest

from vconsole.shared.config import EngineConfig, apply_update, describe_config
from vconsole.telemetry.alerts import AlertEvaluator


def levels(events):
    return [(e.name, e.previous, e.level) for e in events]


def test_a_value_oscillating_around_the_threshold_raises_once_and_does_not_flap():
    ev = AlertEvaluator(EngineConfig())            # waiting warns at 50, hysteresis 0.1
    events = ev.observe(num_waiting=40)
    for value in [51, 49, 52, 48, 50, 47, 53, 46] * 4:       # every one crosses 50 or stays
        events += ev.observe(num_waiting=value)
    assert levels(events) == [("waiting", "ok", "warning")]
    assert ev.active() == {"waiting": "warning"}


def test_it_clears_once_below_threshold_times_one_minus_the_margin():
    ev = AlertEvaluator(EngineConfig(alert_hysteresis=0.2))   # warning 50: clears under 40
    ev.observe(num_waiting=60)
    assert ev.observe(num_waiting=41) == [] and ev.observe(num_waiting=40) == []
    (down,) = ev.observe(num_waiting=39)
    assert (down.previous, down.level, down.threshold) == ("warning", "ok", 50)
    assert "back to 39" in down.message and "under 40" in down.message
    assert ev.observe(num_waiting=45) == []               # under 50: no new warning
    assert levels(ev.observe(num_waiting=50)) == [("waiting", "ok", "warning")]


def test_falling_from_critical_keeps_warning_inside_the_warning_band():
    # step time: warning 0.5 s, critical 1 s, margin 10 %; no hold, each reading alone
    ev = AlertEvaluator(EngineConfig(alert_step_time_window_s=0.1, alert_step_time_raise_s=0,
                                     alert_step_time_clear_s=0))
    t = iter(range(100))

    def steps(p50):
        return ev.observe_steps(float(next(t)), p50, 1)
    steps(1.5)
    assert steps(0.95) == []                                  # above 0.9: still critical
    assert levels(steps(0.47)) == [("step_time", "critical", "warning")]
    assert steps(0.46) == []                                  # above 0.45: still warning
    assert levels(steps(0.44)) == [("step_time", "warning", "ok")]


def test_zero_margin_is_plain_thresholds():
    ev = AlertEvaluator(EngineConfig(alert_hysteresis=0.0))
    events = []
    for value in (51, 49, 51, 49):
        events += ev.observe(num_waiting=value)
    assert [e.level for e in events] == ["warning", "ok", "warning", "ok"]


def test_the_margin_is_a_hot_key_and_rejudges_the_last_reading():
    cfg = EngineConfig(alert_hysteresis=0.0)
    ev = AlertEvaluator(EngineConfig())
    ev.observe(num_waiting=60)
    assert ev.observe(num_waiting=47) == []                   # inside the 10 % band
    assert levels(ev.update_config(cfg)) == [("waiting", "warning", "ok")]
    row = next(r for r in describe_config() if r["key"] == "alert_hysteresis")
    assert row["hot"] and (row["min"], row["max"], row["default"]) == (0.0, 0.5, 0.1)
    assert apply_update(cfg, {"alert_hysteresis": 0.25}).applied == {"alert_hysteresis": 0.25}


@pytest.mark.parametrize("bad", [-0.1, 0.6])
def test_the_margin_is_range_checked(bad):
    update = apply_update(EngineConfig(), {"alert_hysteresis": bad})
    assert "alert_hysteresis" in update.rejected
