"""The fleet read from a real Prometheus (``--prometheus URL``): Debian's ``prometheus`` scraping
our engine (``vconsole engine --metrics-port``), a vLLM stand-in with two ranks, an SGLang
stand-in and a llama.cpp stand-in, each serving its kind's own metric names.

What is checked: one row per instance and engine, of the right kind and model; running and
waiting exactly what each server itself reports; rates and percentiles equal to the PromQL a
reader writes by hand, evaluated at the same instant; the fleet's percentiles are
``histogram_quantile`` of the bucket rates summed ``by (le)`` over the bounds every engine has;
a stopped Prometheus is one clear state (the banner, every row stale) and the next read after
it is back clears it; a Prometheus too slow to answer is the same clear state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.http_standin import StandIn
from support.llama_cpp_stub import LlamaServerStub
from support.ports import free_block
from support.prometheus import Prometheus, require
from support.sglang_metrics import SglangMetrics
from support.vllm_metrics import VllmMetrics
from vconsole.console.sources.fleet.prometheus_query import PromClient, PrometheusSource, read
from vconsole.console.sources.fleet.prometheus_rows import PrometheusFleet
from vconsole.console.state import ConsoleState
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "4", "--metrics-port", "0", "--set", "heartbeat_interval_s=0.2"]
_HTTP = free_block(4)
VLLM_PORT, SGLANG_PORT, LLAMA_PORT, SLOW_PORT = _HTTP, _HTTP + 1, _HTTP + 2, _HTTP + 3


@dataclass
class Stack:
    prom: Prometheus
    engine_instance: str
    vllm: VllmMetrics
    vllm_instance: str
    sglang_instance: str
    llama_instance: str
    llama: LlamaServerStub


def _instance(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require("prometheus")
    folder = tmp_path_factory.mktemp("fleet-prometheus")
    engine = EngineProcess(ENGINE_ARGS, log_path=folder / "engine.log").start(timeout_s=180)
    vllm, sg, ll = VllmMetrics(engines=2), SglangMetrics(), LlamaServerStub()
    prom: Prometheus | None = None
    try:
        vllm_url = vllm.serve()
        sg_url, ll_url = sg.serve(SGLANG_PORT), ll.serve(LLAMA_PORT)
        instances = [_instance(engine.ready["metrics"]), _instance(vllm_url),
                     _instance(sg_url), _instance(ll_url)]
        prom = Prometheus(folder, instances, job="fleet").start()
        prom.wait_until(lambda: prom.values("sum(up)", by="").get("") == 4,
                        "Prometheus never scraped all four")
        # work on every server while Prometheus scrapes, so rates and percentiles have data
        prefix = [11, 12, 13, 14, 15, 16, 17, 18]
        with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
            for k in range(4):
                ids = [client.submit(prompt_token_ids=[*prefix, 20 + i], max_tokens=4 + i,
                                     ignore_eos=True) for i in range(3)]
                for e, waiting in (("0", 3), ("1", 1)):
                    vllm.step(e, running=2 + int(e), waiting=waiting, usage=0.25,
                              prompt=40, generation=30 + 10 * int(e), finished=2, steps=4,
                              ttft=0.03 + 0.4 * int(e), itl=0.02)
                sg.step(running=5, waiting=2, used_tokens=5000, prompt=100, cached=40,
                        generation=60, finished=3, retracted=k % 2, ttft=0.3)
                ll.busy(k % 4, prompt=10, decoded=5 + k)
                ll.values["tokens_predicted_total"] += 25
                ll.values["prompt_tokens_total"] += 10
                client.gather(ids, timeout_s=120)
                time.sleep(1.5)
        time.sleep(2.5)                       # every server idle and scraped since
        yield Stack(prom, instances[0], vllm, instances[1], instances[2], instances[3], ll)
    finally:
        if prom is not None:
            prom.close()
        for s in (vllm, sg, ll):
            s.close()
        engine.stop()


def _scrape(instance: str) -> dict[str, float]:
    """``{name{labels}: value}`` of a server's own /metrics, read directly."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{instance}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + json.dumps(dict(sorted(s.labels.items())))] = s.value
    return out


def _gauge(instance: str, name: str, engine: str | None = None) -> float:
    return sum(v for k, v in _scrape(instance).items() if k.startswith(name + "{")
               and (engine is None or f'"engine": "{engine}"' in k))


def test_top_once_json_has_a_row_per_engine_with_each_servers_own_queues(stack: Stack) -> None:
    r = subprocess.run([sys.executable, "-m", "vconsole", "top", "--prometheus", stack.prom.url,
                        "--selector", '{job="fleet"}', "--once", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"engines", "aggregate", "imbalance"}
    rows = {e["name"]: e for e in doc["engines"]}
    v0, v1 = f"{stack.vllm_instance}/0", f"{stack.vllm_instance}/1"
    assert set(rows) == {stack.engine_instance, v0, v1, stack.sglang_instance,
                         stack.llama_instance}
    kinds = {n: (e["kind"], e["model"], e["state"]) for n, e in rows.items()}
    assert kinds == {stack.engine_instance: ("vconsole", "tiny", "up"),
                     v0: ("vllm", "Qwen/Qwen2-0.5B", "up"), v1: ("vllm", "Qwen/Qwen2-0.5B", "up"),
                     stack.sglang_instance: ("sglang", "meta-llama/Llama-3.1-8B-Instruct", "up"),
                     stack.llama_instance: ("llama-cpp", None, "up")}
    # the queues: exactly what each server reports on its own /metrics
    expect = {stack.engine_instance: (_gauge(stack.engine_instance, "vllm:num_requests_running"),
                                      _gauge(stack.engine_instance, "vllm:num_requests_waiting")),
              v0: (2, 3), v1: (3, 1), stack.sglang_instance: (5, 2),
              stack.llama_instance: (_gauge(stack.llama_instance, "llamacpp:requests_processing"),
                                     _gauge(stack.llama_instance, "llamacpp:requests_deferred"))}
    assert {n: (e["running"], e["waiting"]) for n, e in rows.items()} == expect
    assert rows[stack.sglang_instance]["kv_usage"] == pytest.approx(5000 / 200_000)
    assert rows[stack.llama_instance]["kv_usage"] is None          # llama.cpp has no KV metric
    assert rows[stack.llama_instance]["ttft_p99_s"] is None        # ...nor latency histograms
    for n in (stack.engine_instance, v0, v1, stack.sglang_instance, stack.llama_instance):
        assert rows[n]["gen_tok_s"] > 0, n
    a = doc["aggregate"]
    assert a["engines_up"] == 5
    assert (a["running"], a["waiting"]) == (sum(x for x, _ in expect.values()),
                                            sum(y for _, y in expect.values()))
    assert a["ttft_p99_s"] is not None and a["itl_p99_s"] is not None


def test_rates_and_percentiles_are_the_promql_a_reader_writes_at_the_same_instant(
        stack: Stack) -> None:
    prom, sel = stack.prom, 'job="fleet"'
    at = time.time()
    reading = read(PromClient(prom.url), sel, at)
    source = PrometheusSource(prom.url, '{job="fleet"}')
    source.reading, source.received = reading, at
    doc = PrometheusFleet(source, started=at).document(at)
    rows = {e["name"]: e for e in doc["engines"]}

    def by_row(expr: str) -> dict[str, float]:
        out = {}
        for s in prom.query(expr, at):
            m = s["metric"]
            name = m["instance"] + (f"/{m['engine']}" if m["instance"] == stack.vllm_instance
                                    else "")
            out[name] = float(s["value"][1])
        return out

    v0 = f"{stack.vllm_instance}/0"
    gen = by_row(f'sum by (instance, engine) (rate(vllm:generation_tokens_total{{{sel}}}[1m]))')
    gen |= by_row(f'sum by (instance) (rate(sglang:generation_tokens_total{{{sel}}}[1m]))')
    gen |= by_row(f'sum by (instance) (rate(llamacpp:tokens_predicted_total{{{sel}}}[1m]))')
    assert {n: rows[n]["gen_tok_s"] for n in gen} == pytest.approx(gen)
    ttft = by_row('histogram_quantile(0.99, sum by (instance, engine, le) '
                  f'(rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[1m])))')
    assert rows[v0]["ttft_p99_s"] == pytest.approx(ttft[v0])
    hit = by_row(f'sum by (instance) (rate(sglang:cached_tokens_total{{{sel}}}[1m])) / '
                 f'sum by (instance) (rate(sglang:prompt_tokens_total{{{sel}}}[1m]))')
    assert rows[stack.sglang_instance]["prefix_hit"] == pytest.approx(
        hit[stack.sglang_instance]) == pytest.approx(0.4)
    # the fleet's: vLLM's and SGLang's buckets summed over the bounds both have
    les = reading.fleet_les["ttft_s"]
    assert "+Inf" in les and "0.1" in les and "0.001" not in les and "0.2" not in les
    regex = "|".join(le.replace(".", "\\\\.").replace("+", "\\\\+") for le in les)
    fleet = prom.query('histogram_quantile(0.99, sum by (le) (rate({__name__=~'
                       '"vllm:time_to_first_token_seconds_bucket|'
                       f'sglang:time_to_first_token_seconds_bucket", {sel}, le=~"{regex}"}}[1m])))',
                       at)
    assert doc["aggregate"]["ttft_p99_s"] == pytest.approx(float(fleet[0]["value"][1]))


def test_a_stopped_prometheus_is_one_clear_state_and_recovery_is_by_itself(stack: Stack) -> None:
    state = ConsoleState()
    source = PrometheusSource(stack.prom.url, '{job="fleet"}', timeout_s=2.0)
    fleet = PrometheusFleet(source, started=time.time())
    assert source.read_once(state)
    assert {r.state for r in fleet.rows(state, time.time())} == {"up"}
    stack.prom.close()
    try:
        assert not source.read_once(state)
        assert source.problem is not None and "refused" in source.problem
        banner = state.recent_error()
        assert banner is not None and banner.startswith("PROMETHEUS UNREACHABLE")
        assert "retrying by itself" in banner
        rows = fleet.rows(state, time.time())
        assert len(rows) == 5 and {r.state for r in rows} == {"stale"}
        assert {r.problem for r in rows} == {"Prometheus unreachable"}   # not the engines
        assert fleet.aggregate(rows).engines_up == 0
        r = subprocess.run([sys.executable, "-m", "vconsole", "top", "--prometheus",
                            stack.prom.url, "--once", "--json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "refused" in r.stderr and "Traceback" not in r.stderr
    finally:
        stack.prom.start()
    stack.prom.wait_until(lambda: source.read_once(state), "never read again")
    assert state.recent_error() is None
    # A restarted Prometheus says `up` for each target once it has scraped it again (a
    # random offset within the scrape interval): every row comes back by itself. Each row is
    # asked to be up in some reading, not all in one: on a loaded machine one target's 1 s
    # scrape can time out now and then (`up` 0 for that scrape: the row is down, rightly).
    came_back: set[str] = set()
    last: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while not len(came_back) == len(last) == 5:
        assert time.monotonic() < deadline, f"a row never came back up: {last}"
        if source.read_once(state):
            last.update({r.name: r.state for r in fleet.rows(state, time.time())})
            came_back.update(name for name, st in last.items() if st == "up")
        time.sleep(0.2)


def test_a_prometheus_too_slow_to_answer_is_the_same_clear_state(tmp_path: Path) -> None:
    def slow(path: str) -> tuple[int, str, bytes]:
        time.sleep(3)
        return 200, "application/json", b'{"status": "success", "data": {"result": []}}'
    standin = StandIn(slow)
    url = standin.serve(SLOW_PORT)
    try:
        state = ConsoleState()
        source = PrometheusSource(url, timeout_s=0.5)
        assert not source.read_once(state)          # the timeout ended it, not the server
        assert source.problem is not None and "no answer within 0.5s" in source.problem, \
            source.problem
        assert (state.recent_error() or "").startswith("PROMETHEUS UNREACHABLE")
    finally:
        standin.close()


async def test_the_fleet_screen_from_prometheus_shows_its_rows_then_the_banner_then_recovers(
        stack: Stack) -> None:
    from textual.widgets import Static

    from support.console_testing import until
    from vconsole.console.app import VConsoleApp
    from vconsole.console.screens.fleet import FleetScreen

    source = PrometheusSource(stack.prom.url, '{job="fleet"}', interval_s=0.5, timeout_s=2.0)
    app = VConsoleApp(sources=[source], fleet=PrometheusFleet(source, started=time.time()))

    def shown(state: str) -> bool:
        screen = app.screen
        return isinstance(screen, FleetScreen) and len(screen.row_keys) == 5 and all(
            str(screen.table.get_cell(k, "state")).startswith(state) for k in screen.row_keys)

    def banner() -> str:         # the banner's text while it is shown
        box = app.screen.query_one("#banner", Static)
        return str(box.render()) if box.has_class("-shown") else ""

    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: shown("up"), timeout=20)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        assert str(screen.table.get_cell(stack.sglang_instance, "running")) == "5"
        assert "5/5 up" in str(screen.query_one("#fleet-summary", Static).render())
        stack.prom.close()
        try:
            await until(pilot, lambda: shown("stale") and "PROMETHEUS UNREACHABLE" in banner(),
                        timeout=20)
            assert "0/5 up" in str(screen.query_one("#fleet-summary", Static).render())
        finally:
            stack.prom.start()
        await until(pilot, lambda: shown("up") and "PROMETHEUS" not in banner(), timeout=30)


def test_a_server_prometheus_cannot_scrape_is_down_with_dashes_and_the_others_stay_up(
        stack: Stack) -> None:
    """(Last: it stops the llama.cpp stand-in.)"""
    stack.llama.close()
    prom = stack.prom
    prom.wait_until(lambda: prom.values(f'up{{instance="{stack.llama_instance}"}}',
                                        by="instance").get(stack.llama_instance) == 0,
                    "Prometheus never saw the llama.cpp stand-in go")
    source = PrometheusSource(prom.url, '{job="fleet"}')
    fleet = PrometheusFleet(source, started=time.time())
    assert source.read_once()
    rows = {r.name: r for r in fleet.rows(None, time.time())}
    gone = rows[stack.llama_instance]
    assert (gone.state, gone.running, gone.gen_tok_s) == ("down", None, None)
    assert gone.problem == "Prometheus's scrape of it fails (up 0)"
    assert [r.state for n, r in rows.items() if n != stack.llama_instance] == ["up"] * 4
    doc = fleet.document(time.time())
    assert doc["aggregate"]["engines_up"] == 4
    assert any(f["rule"] == "down" and f["engine"] == stack.llama_instance
               for f in doc["imbalance"])
