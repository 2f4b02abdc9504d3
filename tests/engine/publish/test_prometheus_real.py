"""/metrics scraped by a real Prometheus: `vconsole serve` in front of a two-rank data-parallel
engine, Prometheus (Debian's binary, a generated config, a scrape a second) scraping the server,
requests sent with the openai SDK; then Prometheus's HTTP API is asked what a dashboard asks.

What is checked: every family of the server's own exposition is in Prometheus with the job,
instance, model and engine-rank labels; counters, ``rate()`` and ``histogram_quantile()`` give
exactly what the engine measured (the figures of the server's /metrics, read directly once the
engine is idle); every query of examples/grafana/vconsole.json returns series.

Why exact: Prometheus extrapolates a range's increase to the range's ends, except towards a
counter's zero. The series start at 0 (a fresh engine, scraped before any request) and the
queries are evaluated at the timestamp of the last scrape, so ``increase()`` over a range that
covers the whole run extrapolates nothing and is the counter's value.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.prometheus import DASHBOARD, Prometheus, dashboard_queries, require
from support.serve_process import serve, status, wait_until
from vconsole.engine.launch.child import ChildProcess
from vconsole.engine.launch.engine_process import EngineProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--data-parallel-size", "2", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "8", "--set", "heartbeat_interval_s=0.2", "--metrics-port", "0",
               # vLLM's opt-in series, so the dashboard's panels of them have data too
               "--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--enable-mfu-metrics"]
REQUESTS = 24
RANGE = "1h"                 # longer than the run: covers every sample since the first scrape
RANGE_S = 3600.0
# Dashboard panels whose series need hardware this machine may lack (NVML and a GPU).
NEEDS_GPU = {"GPU Memory", "GPU Utilization"}
# The server's own request-size histograms (vconsole.entrypoints.openai.request_metrics): no
# engine label, the server does not know which rank ran a sample.
SERVER_SIDE = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
               "vllm:request_params_", "vllm:request_prefill_kv_computed_tokens")


@dataclass
class Stack:
    prometheus: Prometheus
    port: int
    usage: list[openai.types.CompletionUsage] = field(default_factory=list)
    at: float = 0.0                  # the timestamp of the last scrape, once the engine is idle
    direct: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.direct.get(name, [])


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _load(port: int) -> list[openai.types.CompletionUsage]:
    """REQUESTS completions from four threads, so both ranks get work."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    usage: list[openai.types.CompletionUsage] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for i in range(k, REQUESTS, 4):
            r = client.completions.create(model="tiny", prompt=[1 + i % 7] * (5 + 3 * i),
                                          max_tokens=4 + i % 9, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage is not None
            with lock:
                usage.append(r.usage)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(usage) == REQUESTS
    return usage


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require("prometheus")
    folder = tmp_path_factory.mktemp("prometheus-real")
    engine = EngineProcess(ENGINE_ARGS, log_path=folder / "engine.log").start(timeout_s=180)
    child: ChildProcess | None = None
    prom: Prometheus | None = None
    try:
        child, port, log = serve(folder, "--engine-ready-file", str(engine.ready_path))
        wait_until(lambda: status(port) == 200, "the server never became healthy", log)
        prom = Prometheus(folder, [f"127.0.0.1:{port}"]).start()
        # the first scrape, counters at 0, before any request
        prom.wait_until(lambda: len(prom.query("vllm:generation_tokens_total")) == 2,
                        "Prometheus never scraped both ranks")
        s = Stack(prom, port)
        s.usage = _load(port)
        # idle: every request counted by the engine, and Prometheus has scraped since
        prom.wait_until(lambda: prom.values("sum(vllm:request_success_total)", by="").get("")
                        == REQUESTS, "Prometheus never saw every request finish")
        time.sleep(3)                       # the idle engine's last telemetry, then scrapes
        s.direct = _scrape(port)
        last = prom.query("timestamp(vllm:generation_tokens_total)")
        s.at = max(float(r["value"][1]) for r in last)
        yield s
    finally:
        if prom is not None:
            prom.close()
        if child is not None:
            child.stop(30, signal.SIGINT)
        code = engine.stop(grace_s=30)
        assert code == 0, engine.log_tail(40)


def test_every_family_the_server_exposes_is_in_prometheus_with_its_labels(stack: Stack) -> None:
    prom = stack.prometheus
    names = {n for n in stack.direct
             if n.startswith(("vllm:", "vconsole:")) and not n.endswith("_created")}
    assert "vllm:num_requests_waiting_by_reason" in names and "vconsole:dp_wave" in names
    assert "vllm:request_params_max_tokens_bucket" in names
    for name in sorted(names):
        series = prom.query(f'{{__name__="{name}"}}', stack.at)
        assert series, name
        for s in series:
            labels = s["metric"]
            assert labels["job"] == "vconsole" and labels["instance"] == f"127.0.0.1:{stack.port}"
            if name.startswith(SERVER_SIDE):
                assert "engine" not in labels, (name, labels)
            else:
                assert labels["engine"] in ("0", "1"), (name, labels)
            if name != "vllm:cache_config_info":       # vLLM's info gauge has no model_name
                assert labels["model_name"] == "tiny", (name, labels)
    ranks = {s["metric"]["engine"] for s in prom.query("vllm:num_requests_running", stack.at)}
    assert ranks == {"0", "1"}


def test_counters_and_their_rates_are_what_the_engine_counted(stack: Stack) -> None:
    prom = stack.prometheus
    generated = sum(u.completion_tokens for u in stack.usage)
    for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:request_success_total", "vconsole:dp_steps_total"):
        direct = sum(v for _, v in stack.samples(name))
        assert sum(prom.values(f"sum by (engine) ({name})", stack.at).values()) == direct, name
    # the request counters started at zero (scraped before any request): nothing extrapolated
    assert set(prom.values(f"min_over_time(vllm:generation_tokens_total[{RANGE}])",
                           stack.at).values()) == {0.0}
    assert sum(prom.values("vllm:generation_tokens_total", stack.at).values()) == generated
    rate = prom.values(f"sum(rate(vllm:generation_tokens_total[{RANGE}]))", stack.at, by="")
    assert rate[""] * RANGE_S == pytest.approx(generated, rel=1e-9)
    increase = prom.values(f"sum(increase(vllm:request_success_total[{RANGE}]))", stack.at,
                           by="")
    assert increase[""] == pytest.approx(REQUESTS, rel=1e-9)


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative ``(le, count)`` buckets."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", ["vllm:e2e_request_latency_seconds",
                                  "vllm:time_to_first_token_seconds",
                                  "vllm:inter_token_latency_seconds"])
def test_histogram_quantile_is_the_engines_histogram_merged_over_ranks(stack: Stack,
                                                                       name: str) -> None:
    summed: dict[float, float] = {}
    for labels, value in stack.samples(f"{name}_bucket"):
        summed[float(labels["le"])] = summed.get(float(labels["le"]), 0.0) + value
    assert summed[math.inf] > 0
    for q in (0.5, 0.9, 0.99):
        got = stack.prometheus.values(
            f"histogram_quantile({q}, sum by (le) (rate({name}_bucket[{RANGE}])))", stack.at,
            by="")[""]
        assert got == pytest.approx(_quantile(q, list(summed.items())), rel=1e-9), q
    mean = stack.prometheus.values(f"sum(rate({name}_sum[{RANGE}])) / "
                                   f"sum(rate({name}_count[{RANGE}]))", stack.at, by="")[""]
    direct = (sum(v for _, v in stack.samples(f"{name}_sum"))
              / sum(v for _, v in stack.samples(f"{name}_count")))
    assert mean == pytest.approx(direct, rel=1e-9)


def test_every_dashboard_query_returns_series(stack: Stack) -> None:
    model = json.loads(DASHBOARD.read_text())
    has_gpu = bool(stack.samples("vconsole:gpu_memory_used_bytes"))
    empty = [(title, expr) for title, expr in dashboard_queries(model, model_name="tiny")
             if (has_gpu or title not in NEEDS_GPU)
             and not stack.prometheus.query(expr, stack.at)]
    assert empty == []


def test_the_dashboard_preview_draws_every_panel_from_this_prometheus(
        stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """scripts/grafana_screenshot.py's renderer over the run: every target of every panel ran
    without an error and returned series, with values wherever the engine measured something
    (a quantile of a histogram nothing was observed in is NaN: the residency histograms when
    no block was evicted); each panel is on the page at its ``gridPos``; Chromium, when
    installed, screenshots the page at the page's size."""
    import re

    from vconsole.tools.dashboard_model import layout
    from vconsole.tools.dashboard_preview import (
        fetch,
        find_chromium,
        png_size,
        render_html,
        screenshot,
    )

    model = json.loads(DASHBOARD.read_text())
    has_gpu = bool(stack.samples("vconsole:gpu_memory_used_bytes"))
    pre = fetch(model, stack.prometheus.url, stack.at - 120, stack.at, scrape_interval_s=1,
                rate_interval_s=60)
    assert [v.id for v in pre.panels] == [p["id"] for p in model["panels"]]
    for view in pre.panels:
        assert view.box == layout(view.panel["gridPos"], pre.width)
        assert len(view.results) == len(view.panel.get("targets", ())), view.title
        for r in view.results:
            assert r.error is None, (view.title, r.expr, r.error)
            if view.title in NEEDS_GPU and not has_gpu:
                continue
            assert r.series, (view.title, r.expr)
            observed = [sum(v for _, v in stack.samples(f"{family}_count"))
                        for family in re.findall(r"([a-z_]+:[a-z_]+?)_(?:bucket|sum|count)\b",
                                                 r.expr)]
            if not observed or any(observed):
                assert any(s.finite() for s in r.series), (view.title, r.expr)
    folder = tmp_path_factory.mktemp("dashboard-preview")
    page = folder / "dashboard.html"
    page.write_text(render_html(pre))
    if find_chromium() is not None:
        screenshot(page, folder / "dashboard.png", pre.width, pre.height)
        assert png_size(folder / "dashboard.png") == (pre.width, pre.height)
