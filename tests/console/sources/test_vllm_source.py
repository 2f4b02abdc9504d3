"""Watching a vLLM server: its /metrics (built as vLLM builds them, `tests.support.vllm_metrics`)
translated into the console's telemetry, `vconsole top --once --json --vllm`, and the console
attached to it at 80x24 and 100x30."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from support.console_testing import until
from support.vllm_metrics import VllmMetrics
from vconsole.console import format as fmt
from vconsole.console.sources.vllm import ScrapeError, VllmScraper, VllmSource, metrics_url
from vconsole.console.sources.vllm_metrics import (
    VllmTranslator,
    parse,
    quantile,
    quantile_bound,
)
from vconsole.telemetry.schema import decode


def bodies(frames_list) -> dict[tuple[int, str], dict]:
    out = {}
    for frames in frames_list:
        m = decode(frames)
        out[(m.rank, m.topic)] = m.payload
    return out


def busy(metrics: VllmMetrics) -> None:
    metrics.step("0", running=5, waiting=3, usage=0.4, prompt=400, generation=200,
                 finished=10, steps=50, ttft=0.05, itl=0.02)
    metrics.step("1", running=1, waiting=0, usage=0.1, prompt=100, generation=50,
                 finished=2, steps=20, ttft=0.5, itl=0.2)


def test_two_scrapes_give_each_engines_queues_kv_rates_and_window_percentiles():
    metrics = VllmMetrics(engines=2)
    tr = VllmTranslator("vllm@test")
    busy(metrics)
    first = bodies(tr.translate(metrics.text(), now=100.0))
    assert first[(0, "step")]["tokens_per_s"] is None        # no window yet: no rate
    busy(metrics)
    b = bodies(tr.translate(metrics.text(), now=102.0))
    for rank, running, waiting, usage in ((0, 5, 3, 0.4), (1, 1, 0, 0.1)):
        assert b[(rank, "sched")]["num_running"] == running
        assert b[(rank, "sched")]["num_waiting"] == waiting
        assert b[(rank, "kv")]["usage"] == pytest.approx(usage)
        assert b[(rank, "kv")]["num_blocks"] == 1000 and b[(rank, "kv")]["block_size"] == 16
        assert b[(rank, "health")]["state"] == "running"
        assert b[(rank, "config")]["values"]["num_gpu_blocks"] == 1000
    step0 = b[(0, "step")]
    assert step0["tokens_per_s"] == pytest.approx(600 / 2.0)     # (400 + 200) tokens in 2 s
    assert step0["steps"] == 50 and step0["num_finished"] == 10
    assert b[(0, "sched")]["waiting_by_reason"] == {"capacity": 3, "deferred": 0}
    assert b[(0, "kv")]["prefix_hit_rate"] == pytest.approx(0.5)
    lat0, lat1 = b[(0, "latency")]["overall"], b[(1, "latency")]["overall"]
    # 0.05 s falls in vLLM's (0.04, 0.06] TTFT bucket; 0.5 s in (0.25, 0.5]
    assert 0.04 < lat0["window"]["ttft_s"]["p50"] <= 0.06
    assert 0.25 < lat1["window"]["ttft_s"]["p99"] <= 0.5
    assert lat0["window"]["ttft_s"]["count"] == 10    # since the first scrape (the delta)
    assert lat0["histograms"]["itl_s"]["bounds"][-1] == math.inf
    assert b[(0, "latency")]["finished"]["length"] == 20
    assert all(p["source"] == "vllm" for p in b.values())
    assert "requests" in b[(0, "sched")]["not_exposed"]
    assert "block_states" in b[(0, "kv")]["not_exposed"]


def test_older_names_nan_missing_series_and_a_restart_do_not_break_it():
    metrics = VllmMetrics(engines=1, legacy=True)
    tr = VllmTranslator("vllm@old")
    metrics.step("0", running=2, waiting=1, usage=0.3, prompt=100, generation=100, finished=5,
                 steps=10)
    tr.translate(metrics.text(), now=10.0)
    metrics.step("0", running=2, waiting=1, usage=0.3, prompt=100, generation=100, finished=5,
                 steps=10)
    b = bodies(tr.translate(metrics.text(), now=11.0))
    assert b[(0, "kv")]["usage"] == pytest.approx(0.3)          # vllm:gpu_cache_usage_perc
    assert b[(0, "kv")]["prefix_queries"] == 200                # vllm:gpu_prefix_cache_*
    assert b[(0, "latency")]["overall"]["window"]["itl_s"]["count"] == 100  # time_per_output, since the first scrape
    assert b[(0, "sched")]["waiting_by_reason"] == {}           # a series it lacks
    # A restart: every counter starts over; NaN and +Inf gauges read as missing.
    fresh = VllmMetrics(engines=1, legacy=True)
    fresh.step("0", running=0, waiting=0, usage=0.0, prompt=5, generation=5, finished=1, steps=1)
    text = fresh.text().replace('vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2-'
                                '0.5B"} 0.0', 'vllm:num_requests_running{engine="0",model_name'
                                '="Qwen/Qwen2-0.5B"} NaN')
    assert "NaN" in text
    b = bodies(tr.translate(text, now=12.0))
    assert b[(0, "sched")]["num_running"] is None
    step = b[(0, "step")]
    assert step["tokens_per_s"] is None and step["steps"] == 0   # no negative rate
    assert b[(0, "latency")]["overall"]["window"]["ttft_s"]["count"] == 1   # window restarted
    assert b[(0, "health")]["uptime_s"] == 0.0


def test_text_that_is_not_prometheus_and_an_unreachable_server_are_scrape_errors():
    with pytest.raises(ValueError):
        parse("this is {not prometheus\n")
    scraper = VllmScraper("http://127.0.0.1:9")   # discard port: nothing listens
    with pytest.raises(ScrapeError):
        scraper.scrape()
    assert scraper.failures == 1
    assert metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("https://h/custom/metrics") == "https://h/custom/metrics"
    with pytest.raises(ValueError):
        metrics_url("ftp://h")


def test_quantile_is_prometheus_histogram_quantile():
    bounds, counts = [1.0, 2.0, math.inf], [10, 20, 20]
    assert quantile(0.5, bounds, counts) == pytest.approx(1.0)
    assert quantile(0.75, bounds, counts) == pytest.approx(1.5)
    assert quantile(0.99, bounds, [0, 0, 5]) == 2.0    # in +Inf: the last finite bound
    assert quantile(0.5, bounds, [0, 0, 0]) is None


def test_a_quantile_in_the_first_last_or_a_wide_bucket_is_only_a_bound():
    """Issue 27 item 4: every queue-time sample in vLLM's first bucket (le=0.3) became
    "p50 150 ms, p99 297 ms"; Prometheus users read that as "< 300 ms"."""
    bounds = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, math.inf]
    first = [20] * len(bounds)
    assert quantile(0.99, bounds, first) == pytest.approx(0.297)   # histogram_quantile's
    assert quantile_bound(0.5, bounds, first) == {"lo": 0.0, "hi": 0.3}
    assert quantile_bound(0.99, bounds, first) == {"lo": 0.0, "hi": 0.3}
    last = [0] * (len(bounds) - 1) + [20]
    assert quantile_bound(0.5, bounds, last) == {"lo": 10.0, "hi": None}
    wide = [0] * 7 + [20] * 3                         # all in (2.5, 5]: 2x, a number
    assert quantile_bound(0.5, bounds, wide) is None
    wider = [0] * 8 + [20] * 2                        # all in (5, 10]: 2x, still a number
    assert quantile_bound(0.5, bounds, wider) is None
    ttft = [0.04, 0.06, 0.08, 0.1, 0.25, 0.5, math.inf]
    in_wide = [0, 0, 0, 0, 20, 20, 20]                # (0.1, 0.25]: 2.5x its lower edge
    assert quantile_bound(0.5, ttft, in_wide) == {"lo": 0.1, "hi": 0.25}
    assert quantile_bound(0.5, ttft, [0, 20, 20, 20, 20, 20, 20]) is None   # (0.04, 0.06]
    assert quantile_bound(0.5, ttft, [0] * 7) is None                     # no samples


def test_a_bound_is_shown_as_a_bound():
    assert fmt.bounded_ms(0.297, {"lo": 0.0, "hi": 0.3}) == "< 300ms"
    assert fmt.bounded_ms(10.0, {"lo": 10.0, "hi": None}) == "> 10s"
    assert fmt.bounded_ms(0.2, {"lo": 0.1, "hi": 0.25}) == "100–250ms"
    assert fmt.bounded_ms(0.8, {"lo": 0.5, "hi": 1.0}) == "500ms–1s"
    assert fmt.bounded_ms(0.297, None) == "297.0ms"               # measured: a number


def test_the_translated_window_carries_the_bound_beside_the_estimate():
    metrics = VllmMetrics(engines=1)
    tr = VllmTranslator("vllm@test")
    tr.translate(metrics.text(), now=100.0)
    for _ in range(20):                                # queue times 0.4 ms to 1.4 ms
        metrics.step("0", running=2, waiting=0, usage=0.1, prompt=10, generation=10,
                     finished=1, steps=5, ttft=0.0008 + 0.0001 * _, itl=0.02)
    window = bodies(tr.translate(metrics.text(), now=101.0))[(0, "latency")]["overall"][
        "window"]
    queue = window["queue_s"]
    assert queue["count"] == 20 and 0.1 < queue["p50"] < 0.3          # the estimate, kept
    assert queue["p50_bound"] == queue["p99_bound"] == {"lo": 0.0, "hi": 0.3}


@pytest.fixture
def server():
    metrics = VllmMetrics(engines=2)
    busy(metrics)
    url = metrics.serve()
    try:
        yield metrics, url
    finally:
        metrics.close()


def test_top_once_json_vllm_prints_each_engine_and_the_aggregate(server):
    metrics, url = server
    out = subprocess.run([sys.executable, "-m", "vconsole", "top", "--once", "--json",
                          "--vllm", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    def not_json(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")
    snap = json.loads(out.stdout, parse_constant=not_json)   # strict: no Infinity / NaN
    assert snap["source"] == {"kind": "vllm", "url": f"{url}/metrics"}
    assert set(snap["ranks"]) == {"0", "1"}
    assert snap["ranks"]["0"]["sched"]["num_running"] == 5
    assert snap["ranks"]["1"]["sched"]["num_waiting"] == 0
    assert snap["ranks"]["0"]["kv"]["usage"] == pytest.approx(0.4)
    assert snap["aggregate"]["num_running"] == 6 and snap["aggregate"]["num_waiting"] == 3
    ttft = snap["ranks"]["0"]["latency"]["overall"]["window"]["ttft_s"]    # since start
    assert ttft["count"] == 10 and 0.04 < ttft["p50"] <= 0.06
    assert "p50_bound" not in ttft                   # a narrow bucket: a number
    queue = snap["ranks"]["0"]["latency"]["overall"]["window"]["queue_s"]
    assert queue["p99_bound"] == {"lo": 0.0, "hi": 0.3}   # all in le=0.3: only "< 300 ms"
    down = subprocess.run([sys.executable, "-m", "vconsole", "top", "--once", "--json",
                           "--vllm", "http://127.0.0.1:9"], capture_output=True, text=True,
                          timeout=120)
    assert down.returncode == 1 and "127.0.0.1:9" in down.stderr


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
async def test_the_console_attached_to_vllm_shows_both_engines(server, size):
    from vconsole.console.app import VConsoleApp

    metrics, url = server
    app = VConsoleApp(source=VllmSource(url, interval_s=0.2, local_gpu=False))
    async with app.run_test(size=size) as pilot:
        for _ in range(100):
            await pilot.pause(0.1)
            if len(app.state.engine_list()) == 2:
                break
        assert {e.rank for e in app.state.engine_list()} == {0, 1}
        assert app.steering.readonly and "vLLM" in app.steering.readonly_reason
        await until(pilot, lambda: "vLLM does not expose step phases" in _text(app, "#phases"))
        if size == (80, 24):      # queue times all in vLLM's first bucket: a bound, not 150 ms
            busy(metrics)         # requests finish within the console's window
            for _ in range(100):
                await pilot.pause(0.1)
                queue = [ln.split() for ln in _text(app, "#latency").splitlines()
                         if ln.startswith("queue")]
                if queue and queue[0][1] != "–":
                    break
            assert queue[0][1:3] == ["<", "300ms"] and queue[0][3:5] == ["<", "300ms"]
        assert "2 ranks" in _text(app, "#summary")          # the engines as a group's ranks
        await pilot.press("3")
        await until(pilot, lambda: "no block map" in _text(app, "#kv-legend"))
        await pilot.press("4")
        await until(pilot, lambda: "vLLM has no runtime config API" in _text(app, "#cfg-summary"))


def _text(app, selector: str) -> str:
    from textual.widgets import Static

    return str(app.screen.query_one(selector, Static).render())


async def test_vllm_actions_are_confirmed_posted_and_a_missing_route_is_explained(server):
    from vconsole.console.app import VConsoleApp
    from vconsole.console.palette import ConsoleCommands
    from vconsole.console.widgets.confirmation import ConfirmScreen

    metrics, url = server
    metrics.dev_mode = True
    app = VConsoleApp(source=VllmSource(url, interval_s=0.2, local_gpu=False))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(100):                          # the source probed the routes, scraped
            await pilot.pause(0.1)
            if app.state.engine_list():
                break
        titles = [t for t, _, _ in ConsoleCommands(app.screen)._commands()]
        assert "vLLM: Reset the prefix cache" in titles and "vLLM: Wake the engine up" in titles
        assert not any(t.startswith("Edit config") for t in titles)   # no config API
        app.run_source_action("reset_prefix_cache")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert metrics.posts == []
        await pilot.press("escape")                   # cancelled: nothing sent
        await pilot.pause(0.2)
        assert metrics.posts == []
        app.run_source_action("reset_prefix_cache")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("tab", "enter")             # the deliberate confirm
        for _ in range(50):
            await pilot.pause(0.1)
            if metrics.posts:
                break
        assert metrics.posts == ["/reset_prefix_cache"]
        app.run_source_action("start_profile", confirmed=True)   # no profiler route: a 404
        for _ in range(50):
            await pilot.pause(0.1)
            if any("profiler-config" in n.message for n in app._notifications):
                break
        assert any("does not answer POST /start_profile" in n.message
                   for n in app._notifications)


async def test_a_readonly_console_offers_no_vllm_action(server):
    from vconsole.console.app import VConsoleApp
    from vconsole.console.palette import ConsoleCommands

    metrics, url = server
    metrics.dev_mode = True
    app = VConsoleApp(source=VllmSource(url, interval_s=0.2, local_gpu=False), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        titles = [t for t, _, _ in ConsoleCommands(app.screen)._commands()]
        assert not any(t.startswith("vLLM:") for t in titles)
        app.run_source_action("reset_prefix_cache", confirmed=True)
        await pilot.pause(0.5)
        assert metrics.posts == []


async def test_without_dev_mode_only_the_profiler_actions_are_offered(server):
    from vconsole.console.app import VConsoleApp
    from vconsole.console.palette import ConsoleCommands

    metrics, url = server                              # dev_mode off: /is_sleeping is a 404
    app = VConsoleApp(source=VllmSource(url, interval_s=0.2, local_gpu=False))
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(100):
            await pilot.pause(0.1)
            if app.state.engine_list():
                break
        titles = {t for t, _, _ in ConsoleCommands(app.screen)._commands()
                  if t.startswith("vLLM:")}
        assert titles == {"vLLM: Start the profiler", "vLLM: Stop the profiler"}
