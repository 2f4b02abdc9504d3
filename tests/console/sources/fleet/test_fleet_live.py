"""The fleet against real targets: two of our engines (both called ``engine-0``: the fleet keeps
them apart by target name) and HTTP stand-ins serving vLLM's, SGLang's and llama.cpp's own
metric names. Every figure of ``top --once --json``'s document equals what each server itself
says at the same moment; a target killed and restarted goes down and comes back, with no
negative rate and without holding up the others; a slow target never blocks a refresh."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.http_standin import StandIn
from support.live_engine import Telemetry
from support.llama_cpp_stub import LlamaServerStub
from support.ports import free_bases, free_block
from support.sglang_metrics import SglangMetrics
from support.vllm_metrics import VllmMetrics
from vconsole.console.sources.fleet.merge import merged_percentile
from vconsole.console.sources.fleet.snapshot import FleetWatch, build_sources, snapshot
from vconsole.console.sources.fleet.targets import make_target
from vconsole.console.sources.vllm_metrics import quantile
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess, loopback_endpoints

pytestmark = [pytest.mark.proc, pytest.mark.slow]

BASES = free_bases(2)         # our two engines' base ports
_HTTP = free_block(4)
VLLM_PORT, SGLANG_PORT, LLAMA_PORT, SLOW_PORT = _HTTP, _HTTP + 1, _HTTP + 2, _HTTP + 3


def engine_args() -> list[str]:
    # Both engines keep the default engine_id ("engine-0"): the fleet must keep them apart.
    return ["--model", "tiny", "--num-kv-blocks", "48", "--max-num-seqs", "4",
            "--set", "heartbeat_interval_s=0.2", "--set", "telemetry_hz=10"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[list[EngineProcess]]:
    work = tmp_path_factory.mktemp("fleet")
    env = {"VCONSOLE_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    procs = [EngineProcess(engine_args(), endpoints=loopback_endpoints(base), env=env,
                           log_path=work / f"engine-{base}.log") for base in BASES]
    try:
        for p in procs:
            p.start(timeout_s=120)
        with EngineClient(procs[0].endpoints["input"], procs[0].endpoints["output"]) as c:
            for i in range(6):
                c.submit(prompt_token_ids=[3 + i] * 12, max_tokens=8, ignore_eos=True)
            c.gather(timeout_s=60)
        yield procs
    finally:
        for p in procs:
            p.stop(grace_s=5)


def vllm_standin(metrics: VllmMetrics) -> StandIn:
    return StandIn(lambda path: (200, "text/plain", metrics.text().encode())
                   if path == "/metrics" else (404, "text/plain", b""))


@pytest.fixture
def others() -> Iterator[tuple[VllmMetrics, SglangMetrics, LlamaServerStub, StandIn]]:
    vm = VllmMetrics(engines=1, model="Qwen/Qwen2-0.5B")
    vm.step("0", running=3, waiting=2, usage=0.4, prompt=500, generation=200, finished=9,
            steps=5, ttft=0.07, itl=0.03)
    sg = SglangMetrics()
    sg.step(running=5, waiting=1, used_tokens=50_000, prompt=900, cached=300, generation=400,
            finished=6, retracted=1, ttft=0.45, itl=0.012)
    ll = LlamaServerStub(slots=2, n_ctx=1024)
    ll.busy(0, prompt=200, decoded=56)
    ll.values["tokens_predicted_total"] = 777
    vs = vllm_standin(vm)
    vs.serve(VLLM_PORT)
    sg.serve(SGLANG_PORT)
    ll.serve(LLAMA_PORT)
    yield vm, sg, ll, vs
    for s in (vs, sg, ll):
        s.close()


def targets():
    return [make_target("vconsole", f"127.0.0.1:{BASES[0]}", name="ours-a"),
            make_target("vconsole", f"127.0.0.1:{BASES[1]}", name="ours-b"),
            make_target("vllm", f"127.0.0.1:{VLLM_PORT}", name="vllm"),
            make_target("sglang", f"127.0.0.1:{SGLANG_PORT}", name="sglang"),
            make_target("llama-cpp", f"127.0.0.1:{LLAMA_PORT}", name="llama")]


def own_hist(text: str, name: str) -> dict:
    """A histogram as the server itself exposes it (its buckets summed over its label sets),
    read with prometheus_client's parser, not ours."""
    by_le: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                    by_le[le] = by_le.get(le, 0.0) + s.value
    bounds = sorted(by_le)
    return {"bounds": bounds, "counts": [by_le[b] for b in bounds], "count": by_le[math.inf],
            "sum": 0.0}


def test_every_figure_equals_the_servers_own(engines, others):
    vm, sg, ll, _ = others
    tel = Telemetry(engines[0].endpoints["telemetry"])
    try:
        tel.wait_for("kv", lambda p: p["usage"] == 0.0, timeout_s=20)    # idle, all done
        doc, problems = snapshot(targets(), timeout_s=30)
        own_latency, own_kv = tel.topic("latency")[-1], tel.topic("kv")[-1]
    finally:
        tel.close()
    assert problems == []
    rows = {e["name"]: e for e in doc["engines"]}
    assert set(rows) == {"ours-a", "ours-b", "vllm", "sglang", "llama"}
    assert all(e["state"] == "up" for e in rows.values())
    a = rows["ours-a"]                       # idle now: its queues and KV hold still
    assert (a["kind"], a["running"], a["waiting"]) == ("vconsole", 0, 0)
    assert a["kv_usage"] == own_kv["usage"] and a["model"] == "tiny"
    h = own_latency["overall"]["histograms"]["ttft_s"]
    assert a["ttft_p50_s"] == quantile(0.5, h["bounds"], h["counts"])
    assert rows["ours-b"]["ttft_p50_s"] is None                  # it served nothing
    v = rows["vllm"]
    assert (v["running"], v["waiting"], v["kv_usage"], v["model"]) == (3, 2, 0.4,
                                                                       "Qwen/Qwen2-0.5B")
    vh = own_hist(vm.text(), "vllm:time_to_first_token_seconds")
    assert v["ttft_p99_s"] == quantile(0.99, vh["bounds"], vh["counts"])
    s = rows["sglang"]
    assert (s["running"], s["waiting"], s["kv_usage"]) == (5, 1, 50_000 / 200_000)
    assert s["prefix_hit"] == 300 / 900
    l_ = rows["llama"]
    assert (l_["running"], l_["kv_usage"], l_["kv_usage_estimated"]) == (1, 256 / 2048, True)
    assert l_["ttft_p99_s"] is None and l_["itl_p99_s"] is None
    agg = doc["aggregate"]
    assert (agg["engines_up"], agg["running"], agg["waiting"]) == (5, 9, 3)
    sh = own_hist(sg.text(), "sglang:time_to_first_token_seconds")
    merged = merged_percentile(0.99, [h, vh, sh])
    assert agg["ttft_p99_s"] == merged.value
    assert set(doc) == {"engines", "aggregate", "imbalance"}


def test_a_killed_http_target_goes_down_then_comes_back_without_negative_rates(others):
    vm, *_, vs = others
    watch = FleetWatch(build_sources(targets()[2:])[0]).start()
    try:
        wait_state(watch, "vllm", "up", 15)
        vs.close()                                         # the server dies
        t0 = time.monotonic()
        wait_state(watch, "vllm", "down", 15)
        assert time.monotonic() - t0 < 10
        assert row(watch, "sglang").state == "up"          # the others never waited
        fresh = VllmMetrics(engines=1)                     # restarted: counters from zero
        fresh.step("0", running=1, waiting=0, usage=0.1, generation=10, finished=1)
        restarted = vllm_standin(fresh)
        restarted.serve(VLLM_PORT)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                r = row(watch, "vllm")
                assert r.gen_tok_s is None or r.gen_tok_s >= 0
                if r.state == "up" and r.running == 1:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"vllm did not come back: {row(watch, 'vllm')}")
            for _ in range(10):
                fresh.step("0", running=1, waiting=0, usage=0.1, generation=5)
                r = row(watch, "vllm")
                assert r.gen_tok_s is None or r.gen_tok_s >= 0
                time.sleep(0.3)
        finally:
            restarted.close()
    finally:
        watch.stop()


def test_a_killed_engine_of_ours_goes_down_and_comes_back(engines):
    proc = engines[1]
    watch = FleetWatch(build_sources(targets()[:2])[0]).start()
    try:
        wait_state(watch, "ours-b", "up", 20)
        os.kill(proc.pid or 0, signal.SIGKILL)
        wait_state(watch, "ours-b", "down", 15)
        assert row(watch, "ours-a").state == "up"
        proc.stop(grace_s=2)
        first_run = proc.ready_path.parent
        proc.start(timeout_s=120)
        # The restart is a run of its own: a new private folder for its ready file, the
        # removed one (its path was in the first child's argv) never reused.
        assert proc.ready_path.parent != first_run and not first_run.exists()
        wait_state(watch, "ours-b", "up", 30)
    finally:
        watch.stop()


def test_a_slow_target_never_holds_up_the_others(others):
    stop = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            stop.wait(20)                       # answers nothing for 20 s

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", SLOW_PORT), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ts = [*targets()[2:4], make_target("vllm", f"127.0.0.1:{SLOW_PORT}", name="slow")]
    watch = FleetWatch(build_sources(ts)[0]).start()
    try:
        wait_state(watch, "vllm", "up", 10)
        seen = set()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:      # the fast ones keep being read every second
            seen.add(watch.state.engines["vllm/0"].last_heartbeat)
            time.sleep(0.25)
        assert len(seen) >= 4
        assert row(watch, "slow").state in ("starting", "down")
        assert row(watch, "sglang").state == "up"
    finally:
        stop.set()
        watch.stop()
        server.shutdown()
        server.server_close()


def test_a_target_of_another_kind_is_one_clear_line(others):
    doc, problems = snapshot([make_target("vllm", f"127.0.0.1:{SGLANG_PORT}", name="x")],
                             timeout_s=5)
    assert problems == [f"x: said vllm, but http://127.0.0.1:{SGLANG_PORT}/metrics has no "
                        "vllm:* series: it looks like sglang"]
    assert doc["engines"][0]["state"] == "down"


def row(watch: FleetWatch, name: str):
    return next(r for r in watch.rows() if r.name == name)


def wait_state(watch: FleetWatch, name: str, state: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if row(watch, name).state == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} not {state} within {timeout_s} s: {row(watch, name)}")



def test_two_engines_of_ours_called_alike_are_recorded_apart(engines, tmp_path):
    from vconsole.console.sources.fleet.recording import record_fleet, recorded_targets

    path = tmp_path / "ours.vrec"
    total, problems = record_fleet(targets()[:2], path, 3.0, log=lambda _m: None)
    assert total > 0 and problems == []
    recorded, _ = recorded_targets(path)
    assert {(t.name, t.kind) for t in recorded} == {("ours-a", "vconsole"),
                                                   ("ours-b", "vconsole")}


def test_discover_finds_our_engine_by_its_telemetry_and_skips_its_other_sockets(engines):
    from vconsole.console.sources.fleet.detect import discover

    base = BASES[0]
    found, skipped = discover("127.0.0.1", list(range(base, base + 4)))
    assert [(t.kind, t.url) for t in found] == [("vconsole", f"tcp://127.0.0.1:{base}")]
    assert len(skipped) == 3          # input, output and control: not what it looks for
