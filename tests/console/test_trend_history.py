"""The data model's side of issue #10: the ``latency`` topic and the Trends screen's history.

A trend keeps one point per second for 15 minutes whatever the message rate; the latency topic is
folded in from the same ingest path as every other topic; a stream without it (an older engine, a
recording) leaves the latency history empty instead of failing.
"""

from __future__ import annotations

import math

from support.console_testing import frames
from support.synthetic import generate
from vconsole.console import format as fmt
from vconsole.console.state import ConsoleState
from vconsole.console.trend_history import HISTORY_S, MAX, MEAN, Trend, TrendHistory
from vconsole.console.widgets import panels
from vconsole.console.widgets.panels import DEFAULT_LIMITS
from vconsole.engine.latency import LatencyStats

T = 1_700_000_000.0


def topic_of(record) -> str:
    return bytes(record[1][0]).decode()


def test_a_trend_folds_each_second_into_one_point():
    mean, peak = Trend(MEAN), Trend(MAX)
    for dt, v in ((0.0, 1.0), (0.3, 3.0), (0.6, 5.0), (1.2, 10.0)):   # the last: next second
        for tr in (mean, peak):
            tr.add(T + dt, v)
    t, v = mean.points()
    assert t.tolist() == [T + 0.5, T + 1.5]            # bin centres, the open bin last
    assert v.tolist() == [3.0, 10.0]
    assert peak.points()[1].tolist() == [5.0, 10.0]
    assert len(mean) == 2 and mean.last == 10.0


def test_a_trend_is_bounded_to_fifteen_minutes_and_keeps_order():
    tr = Trend()
    for s in range(2000):
        for k in range(10):                               # 10 Hz telemetry
            tr.add(T + s + k / 10, float(s))
    assert tr.capacity == HISTORY_S
    t, v = tr.points()
    assert len(t) == tr.capacity + 1                      # the ring plus the open second
    assert v.tolist() == [float(s) for s in range(2000 - len(t), 2000)]
    assert (t[1:] > t[:-1]).all()
    t1, v1 = tr.points(now=T + 2000, window_s=60)
    assert len(t1) == 60 and v1[-1] == 1999.0


def test_a_trend_ignores_nonfinite_values_and_folds_late_samples_into_the_open_second():
    tr = Trend()
    tr.add(T + 5.2, 1.0)
    tr.add(T + 5.4, math.nan)
    tr.add(T + 3.0, 3.0)                                  # clock stepped back
    assert tr.points()[1].tolist() == [2.0]


def test_latency_percentiles_are_ingested_into_history_and_sparklines():
    recs = list(generate(duration_s=10, seed=2))
    s = ConsoleState(clock=lambda: recs[-1][0])
    s.feed(recs)
    eng = s.engine()
    assert s.malformed == 0
    lat = eng.latest["latency"]
    window = lat["overall"]["window"]
    assert lat["window_s"] == 60.0 and set(lat["priority"]) <= {"0", "1", "5"}
    assert eng.trends["ttft_p99_s"].last == window["ttft_s"]["p99"]
    assert eng.trends["itl_p50_s"].last == window["itl_s"]["p50"]
    assert eng.series["queue_p99"].last == window["queue_s"]["p99"]
    n_latency = sum(topic_of(r) == "latency" for r in recs)
    assert len(eng.trends["ttft_p99_s"]) == n_latency    # about one a second, one point each
    assert len(eng.trends["tokens_per_s"]) == 11          # 10 s at 5 Hz: 11 seconds touched


def test_a_stream_without_latency_leaves_the_latency_history_empty():
    recs = list(generate(duration_s=3, latency=False))
    s = ConsoleState(clock=lambda: recs[-1][0])
    s.feed(recs)
    eng = s.engine()
    assert "latency" not in eng.latest and s.malformed == 0
    assert len(eng.trends["ttft_p99_s"]) == 0 and len(eng.trends["kv_usage"]) > 0


def test_empty_windows_and_odd_shapes_add_no_points():
    s = ConsoleState(clock=lambda: T)
    empty = LatencyStats().snapshot(T)                       # no request finished yet
    s.ingest(frames("latency", empty, ts=T), T)
    assert s.malformed == 0
    # A payload of the wrong shape may be counted as malformed; it must not break anything.
    s.ingest(frames("latency", {"window_s": 60.0, "overall": "?", "priority": {},
                                "finished": {}}, seq=1, ts=T + 1), T + 1)
    eng = s.engine()
    assert len(eng.trends["ttft_p99_s"]) == 0 and len(eng.series["ttft_p99"]) == 0
    text = panels.latency(eng, T + 1, 36, DEFAULT_LIMITS)
    assert "TTFT" in text and "–" in text                    # rows, with no numbers to show


def test_synthetic_latency_leaves_every_other_topic_as_it_was():
    with_lat = [r for r in generate(duration_s=4) if topic_of(r) != "latency"]
    without = list(generate(duration_s=4, latency=False))
    assert len(with_lat) == len(without)
    for (ta, fa), (tb, fb) in zip(with_lat, without, strict=True):
        assert ta == tb and [bytes(f) for f in fa] == [bytes(f) for f in fb]


def test_latency_panel_shows_window_percentiles():
    stats = LatencyStats(window_s=30.0)
    for i, v in enumerate((0.010, 0.020, 0.030, 0.040, 2.5)):
        stats.observe("ttft_s", v, 0, T + i)
        stats.observe("e2e_s", v * 10, 0, T + i)
    s = ConsoleState(clock=lambda: T + 5)
    s.ingest(frames("latency", stats.snapshot(T + 5), ts=T + 5), T + 5)
    eng = s.engine()
    w = eng.latest["latency"]["overall"]["window"]
    text = panels.latency(eng, T + 5, 36, DEFAULT_LIMITS)
    ttft = next(line for line in text.splitlines() if "TTFT" in line)
    assert fmt.ms(w["ttft_s"]["p50"]) in ttft and fmt.ms(w["ttft_s"]["p99"]) in ttft
    assert panels.latency_title(eng) == "Latency p50/p99 · 30s · 5 req"
    assert panels.latency_title(None) == "Latency p50/p99"


def test_history_only_listens_to_its_topics():
    h = TrendHistory()
    h.add("alert", {"tokens_per_s": 5.0}, T)
    h.add("step", {"tokens_per_s": 5.0, "step_time_max_s": 0.2}, T)
    assert h["tokens_per_s"].last == 5.0 and h["step_max_s"].last == 0.2
    assert len(h["waiting"]) == 0
