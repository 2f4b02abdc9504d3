"""The step-time alert judges the median step time of the last few seconds, with hold times:
a noisy but steady machine raises once and clears once, a real slowdown still raises within
seconds. Fed as the publisher feeds it: one call per 100 ms snapshot window that finished steps,
and one per idle pass; time is the caller's clock, so these run in simulated time."""

import random
import statistics

import pytest

from vconsole.shared.config import EngineConfig, apply_update, describe_config
from vconsole.telemetry.alerts import AlertEvaluator

SNAPSHOT_S = 0.1      # the publisher's snapshot period at telemetry_hz = 10


def run(ev: AlertEvaluator, durations: list[float], *, t0: float = 0.0,
        idle_after_s: float = 0.0) -> list[tuple[float, str, str, float]]:
    """Steps of ``durations`` back to back from ``t0``, judged per snapshot window as the
    publisher does (a window with no finished step is not fed: the engine runs, maybe stuck);
    then ``idle_after_s`` of idle passes. Returns (time, previous, level, value) per event."""
    ends, t = [], t0
    for d in durations:
        t += d
        ends.append((t, d))
    events, i, now = [], 0, t0
    while i < len(ends):
        now += SNAPSHOT_S
        window = []
        while i < len(ends) and ends[i][0] <= now:
            window.append(ends[i][1])
            i += 1
        if window:
            for e in ev.observe_steps(now, statistics.median(window), len(window)):
                events.append((now, e.previous, e.level, e.value))
    end = now + idle_after_s
    while now < end:
        now += SNAPSHOT_S
        for e in ev.observe_steps(now, 0.0, 0):
            events.append((now, e.previous, e.level, e.value))
    return events


def noisy(seconds: float, seed: int, lo: float = 0.21, hi: float = 0.88) -> list[float]:
    """A shared machine's steps: each anywhere in ``lo``..``hi`` s, independent of the last."""
    rng, out = random.Random(seed), []
    while sum(out) < seconds:
        out.append(rng.uniform(lo, hi))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_noisy_steady_machine_raises_once_and_clears_once(seed):
    cfg = EngineConfig()             # warning 0.5 s, window 5 s, raise after 2 s, clear 20 s
    steps = noisy(90, seed)
    events = run(AlertEvaluator(cfg), steps, idle_after_s=40)
    levels = [(prev, lvl) for _, prev, lvl, _ in events]
    assert levels in ([], [("ok", "warning"), ("warning", "ok")]), events
    if levels:
        assert events[1][0] > sum(steps)          # it clears once the load is gone
    # The same steps judged one snapshot window at a time with no hold (what the alert did
    # before): it flapped all along.
    flat = EngineConfig(alert_step_time_window_s=0.1, alert_step_time_raise_s=0,
                        alert_step_time_clear_s=0)
    assert len(run(AlertEvaluator(flat), steps)) >= 20


def test_alternating_fast_and_slow_steps_within_a_second_raise_once_and_clear_once():
    # 0.21, 0.88, 0.55, 0.79 ... : every second swings across the threshold and back; most
    # steps are slower than 0.5 s, so the median is, and it says so once.
    pattern = [0.21, 0.88, 0.55, 0.79, 0.30, 0.84, 0.62, 0.71]
    events = run(AlertEvaluator(EngineConfig()), pattern * 15, idle_after_s=40)
    assert [(prev, lvl) for _, prev, lvl, _ in events] == [("ok", "warning"), ("warning", "ok")]
    assert events[1][0] > sum(pattern) * 15


def test_a_sustained_slowdown_raises_within_the_window_and_the_hold():
    cfg = EngineConfig()
    ev = AlertEvaluator(cfg)
    fast = [0.05] * 600                                     # 30 s of healthy steps
    assert run(ev, fast) == []
    start = sum(fast)
    events = run(ev, [0.8] * 40, t0=start)                 # then every step takes 0.8 s
    assert [(prev, lvl) for _, prev, lvl, _ in events] == [("ok", "warning")]
    when, _, _, value = events[0]
    assert value == pytest.approx(0.8)
    assert when - start <= cfg.alert_step_time_window_s + cfg.alert_step_time_raise_s + 1


def test_a_few_slow_steps_among_fast_ones_raise_nothing():
    steps = [0.05] * 100 + [0.9, 0.05, 1.5, 0.05, 0.7] + [0.05] * 200   # prefills, a spike
    assert run(AlertEvaluator(EngineConfig()), steps) == []


def test_an_engine_that_finishes_no_step_keeps_its_level_and_idle_clears_after_the_hold():
    cfg = EngineConfig()
    ev = AlertEvaluator(cfg)
    events = run(ev, [0.7] * 10)
    assert [lvl for _, _, lvl, _ in events] == ["warning"]
    # Running, no step finished (stuck inside one?): nothing is fed, nothing moves.
    assert ev.active() == {"step_time": "warning"}
    # Idle from the last step on: the window empties after its 5 s, then the clear hold runs.
    out, now = [], 7.0
    while not out and now < 200:
        now += SNAPSHOT_S
        out = ev.observe_steps(now, 0.0, 0)
    assert [(e.previous, e.level) for e in out] == [("warning", "ok")]
    assert now - 7.0 == pytest.approx(cfg.alert_step_time_window_s
                                      + cfg.alert_step_time_clear_s, abs=0.25)
    assert "back to 0 ms" in out[0].message and "for 20 s" in out[0].message
    assert ev.active() == {}


def test_the_raise_message_says_what_was_judged():
    ev = AlertEvaluator(EngineConfig())
    (e,) = [e for t in range(40) for e in ev.observe_steps(t * 0.1, 0.62, 1)]
    assert e.message == ("median step time of the last 5 s is 620 ms (>= warning threshold "
                         "500 ms for 2 s)")


def test_a_hot_change_of_the_hold_applies_at_the_next_window():
    ev = AlertEvaluator(EngineConfig(alert_step_time_raise_s=60))
    assert run(ev, [0.7] * 10) == []                       # 7 s above, a 60 s hold
    (e,) = ev.update_config(EngineConfig(alert_step_time_raise_s=0))
    assert (e.previous, e.level) == ("ok", "warning")


@pytest.mark.parametrize("key", ["alert_step_time_window_s", "alert_step_time_raise_s",
                                 "alert_step_time_clear_s"])
def test_the_window_and_holds_are_hot_range_checked_keys(key):
    row = next(r for r in describe_config() if r["key"] == key)
    assert row["hot"] and row["min"] is not None and row["max"] is not None
    assert key in apply_update(EngineConfig(), {key: -1.0}).rejected
    assert apply_update(EngineConfig(), {key: 3.0}).applied == {key: 3.0}
