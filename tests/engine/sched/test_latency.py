"""Latency on the engine's clock: vLLM's histogram buckets, window percentiles, per priority."""

import math

import pytest

from support.scheduling import make_request, make_scheduler
from vconsole.engine.latency import (
    ITL_BUCKETS,
    MAX_WINDOW_SAMPLES,
    TTFT_BUCKETS,
    Histogram,
    LatencyStats,
    SlidingWindow,
)
from vconsole.engine.sched.output import ModelRunnerOutput


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_histogram_counts_are_cumulative_over_vllm_bounds():
    h = Histogram(TTFT_BUCKETS)
    for v in (0.0005, 0.001, 0.3, 5000.0):
        h.observe(v)
    d = h.to_dict()
    assert d["bounds"][-1] == math.inf and len(d["counts"]) == len(TTFT_BUCKETS) + 1
    assert d["counts"][0] == 2            # <= 0.001 (upper bounds are inclusive)
    assert d["counts"][TTFT_BUCKETS.index(0.5)] == 3
    assert d["counts"][-1] == d["count"] == 4 and d["sum"] == 0.0005 + 0.001 + 0.3 + 5000.0


def test_the_window_forgets_old_observations_and_stays_bounded():
    w = SlidingWindow(10.0)
    for i in range(20):
        w.observe(100.0 + i, float(i))
    p = w.percentiles(120.0)  # one-second bins: 110 .. 119 are inside the last 10 s
    assert p["count"] == 10 and p["p50"] == 14.5
    for _ in range(MAX_WINDOW_SAMPLES + 500):
        w.observe(119.7, 1.0)
    assert w.percentiles(119.8)["count"] == MAX_WINDOW_SAMPLES
    assert w.percentiles(1000.0)["count"] == 0 and w.percentiles(1000.0)["p99"] is None


def test_the_scheduler_records_ttft_itl_and_request_times_on_its_clock():
    clock = Clock()
    s = make_scheduler(clock=clock)
    a = make_request("a", 4, max_tokens=3, priority=0, arrival=clock.t)
    b = make_request("b", 4, max_tokens=1, priority=5, arrival=clock.t)
    s.add_request(a)
    s.add_request(b)
    clock.t += 0.5                                   # both wait 0.5 s
    for gap in (0.2, 0.1, 0.1):                      # each step takes ``gap``
        so = s.schedule()
        clock.t += gap
        s.update_from_output(so, ModelRunnerOutput({r: 7 for r in so.num_scheduled_tokens}))
    snap = LatencyStats().add(s.latency_batch()).snapshot(clock.t)
    overall, prio0 = snap["overall"], snap["priority"]["0"]
    assert overall["histograms"]["ttft_s"]["count"] == 2         # one first token each
    assert abs(prio0["histograms"]["ttft_s"]["sum"] - 0.7) < 1e-9   # queued 0.5 + step 0.2
    itl = prio0["histograms"]["itl_s"]
    assert itl["count"] == 2 and abs(itl["sum"] - 0.2) < 1e-9  # a's 2nd and 3rd tokens
    assert len(itl["counts"]) == len(ITL_BUCKETS) + 1
    e2e = overall["window"]["e2e_s"]
    assert e2e["count"] == 2 and abs(e2e["p50"] - (0.7 + 0.9) / 2) < 1e-9
    assert abs(prio0["window"]["queue_s"]["p99"] - 0.5) < 1e-9
    assert abs(snap["priority"]["5"]["window"]["decode_s"]["p50"]) < 1e-9  # one token: 0
    assert snap["finished"] == {"length": 2}


def test_a_request_that_never_produced_a_token_has_no_ttft():
    clock = Clock()
    s = make_scheduler(clock=clock)
    s.add_request(make_request("gone", 4, arrival=clock.t))
    clock.t += 1.0
    s.abort_requests("gone")
    s.update_from_output(s.schedule(), ModelRunnerOutput())
    snap = LatencyStats().add(s.latency_batch()).snapshot(clock.t)["overall"]
    assert snap["histograms"]["ttft_s"]["count"] == 0
    assert snap["histograms"]["e2e_s"]["count"] == 1


def test_stats_are_per_priority_as_well_as_overall():
    lat = LatencyStats(60.0)
    lat.observe("ttft_s", 0.1, priority=0, now=1.0)
    lat.observe("ttft_s", 0.3, priority=2, now=1.0, times=2)
    snap = lat.snapshot(2.0)
    assert snap["overall"]["histograms"]["ttft_s"]["count"] == 3
    assert snap["priority"]["2"]["histograms"]["ttft_s"]["count"] == 2
    assert snap["priority"]["0"]["window"]["ttft_s"]["p50"] == 0.1


def test_a_steps_tokens_recorded_at_once_publish_what_one_by_one_would():
    """The scheduler records a step's inter-token gaps in one call, binned later in bulk: the
    snapshot must be the one of observing each value on its own (counts, sums, windows)."""
    import random

    rng = random.Random(3)
    lat = LatencyStats(30.0)
    hist, window = Histogram(ITL_BUCKETS), SlidingWindow(30.0)          # one value at a time
    hist5, window5 = Histogram(ITL_BUCKETS), SlidingWindow(30.0)        # priority 5 only
    t = 100.0
    for _ in range(400):
        t += rng.random() * 0.05
        values = [rng.random() * 0.3 - 0.01 for _ in range(rng.randint(0, 9))]
        prios = [rng.choice((0, 1, 5)) for _ in values]
        lat.observe_many("itl_s", values, prios, t)
        for v, p in zip(values, prios, strict=True):
            v = max(0.0, v)                                            # negative gaps clamp
            hist.observe(v)
            window.observe(t, v)
            if p == 5:
                hist5.observe(v)
                window5.observe(t, v)
    snap = lat.snapshot(t)
    assert snap["overall"]["histograms"]["itl_s"] == hist.to_dict()
    assert snap["overall"]["window"]["itl_s"] == window.percentiles(t)
    assert snap["priority"]["5"]["histograms"]["itl_s"] == hist5.to_dict()
    assert snap["priority"]["5"]["window"]["itl_s"] == window5.percentiles(t)


def test_an_undrained_log_stays_bounded_and_its_batch_still_carries_everything(monkeypatch):
    """An engine nobody drains (no publisher) folds a full series into its overflow instead
    of growing; the next batch merges into the publisher's aggregate as if it had observed
    each value itself."""
    from vconsole.engine import latency

    monkeypatch.setattr(latency, "MAX_PENDING", 64)
    log, hist, window = latency.LatencyLog(), Histogram(ITL_BUCKETS), SlidingWindow(60.0)
    for i in range(1000):
        value, now = (i % 37) * 0.01, 100.0 + i * 0.01
        log.observe("itl_s", value, i % 2, now)
        hist.observe(value)
        window.observe(now, value)
        assert len(log._pending["itl_s"].values) < 64
    snap = LatencyStats(60.0).add(log.drain(110.0, 60.0)).snapshot(110.0)["overall"]
    got = snap["histograms"]["itl_s"]
    assert got["count"] == 1000 and got["counts"] == hist.to_dict()["counts"]
    assert got["sum"] == pytest.approx(hist.sum)
    assert snap["window"]["itl_s"] == window.percentiles(110.0)
