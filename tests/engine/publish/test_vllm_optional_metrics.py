"""vLLM's opt-in metrics on /metrics: --kv-cache-metrics (the vllm:kv_block_*_seconds
histograms, sampled KV block residency) and --enable-mfu-metrics (the
vllm:estimated_*_per_gpu_total counters), through the engine's stats, the hand-off and the
publisher, in-process and in a real engine process."""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.publish.bodies import KVFormat
from vconsole.engine.publish.mfu import ModelDims, step_perf
from vconsole.engine.publish.prometheus import TelemetryCollector
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import RESIDENCY_BUCKETS, StepStats
from vconsole.telemetry import schema
from vconsole.telemetry.listener import TelemetryListener

FAST: dict[str, Any] = {"telemetry_hz": 50.0, "heartbeat_interval_s": 0.2}
RESIDENCY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
             "vllm:kv_block_reuse_gap_seconds")
PERF = ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
        "vllm:estimated_write_bytes_per_gpu_total")
VLLM_LE = [*(repr(float(b)) for b in RESIDENCY_BUCKETS), "+Inf"]
TINY = ModelDims(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                 intermediate_size=688, vocab_size=259, activation_bytes=4, weight_bytes=4,
                 cache_bytes=4)


class Last:
    """The last message of each topic a publisher sent."""

    def __init__(self, endpoint: str) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on)

    def _on(self, msg: schema.TelemetryMessage) -> None:
        with self._lock:
            self.bodies[msg.topic] = msg.payload

    def wait_for(self, topic: str, pred: Any, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                body = self.bodies.get(topic)
            if body is not None and pred(body):
                return body
            time.sleep(0.02)
        raise AssertionError(f"no {topic} message matched in {timeout_s} s: {body}")

    def close(self) -> None:
        self._listener.close(None)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def buckets(fams: dict[str, Any], name: str) -> list[tuple[str, float]]:
    return [(s.labels["le"], s.value) for s in fams[name].samples
            if s.name == name + "_bucket"]


def value(fams: dict[str, Any], sample: str) -> float:
    (v,) = [s.value for f in fams.values() for s in f.samples if s.name == sample]
    return v


def step(rows: list[tuple[int, int]]) -> StepStats:
    prefill = [(s, n) for s, n in rows if n > 1]
    return StepStats(schedule_ns=1_000, execute_ns=1_000, update_ns=1_000, total_ns=3_000,
                     num_prefill_tokens=sum(n for _, n in prefill),
                     num_decode_tokens=sum(n for _, n in rows if n == 1), num_reqs=len(rows),
                     num_context_tokens=sum(s + n for s, n in rows),
                     prefill_attention=sum(n * (s + n) for s, n in prefill),
                     num_prefill_reqs=len(prefill),
                     prefill_context_tokens=sum(s + n for s, n in prefill))


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_samples_and_steps_handed_over_come_out_as_vllms_series(process: bool) -> None:
    config = EngineConfig(**FAST, kv_cache_metrics=True, enable_mfu_metrics=True)
    fmt = KVFormat("float32", 4 * 4 * 2 * 64 * 2, dims=TINY)
    ctx = zmq.Context()
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-0", 0, config, kv_format=fmt,
                             process=process, metrics=("127.0.0.1", 0) if process else None,
                             model_name="tiny")
    pub.start()
    last = Last(pub.endpoint)
    try:
        last.wait_for("health", lambda b: True)
        steps = [step([(0, 10)]), step([(10, 1)]), step([(11, 1), (0, 7)])]
        for s in steps:
            pub.record_step(s)
        pub.set_state("idle")      # as the engine going idle: buffered steps go over now
        pub.submit_kv_residency([(2.5, 0.004, ()), (700.0, 30.0, (0.5, 1.5, 1500.0))])
        flops = sum(step_perf(TINY, s)[0] for s in steps)
        body = last.wait_for("step", lambda b: b.get("perf", {}).get("flops_total") == flops
                             and b["kv_residency"]["lifetime_s"]["count"] == 2)
        if process:
            assert pub.metrics_url is not None
            with urllib.request.urlopen(pub.metrics_url, timeout=10) as resp:
                text = resp.read().decode()
        else:
            from prometheus_client import CollectorRegistry, generate_latest
            registry = CollectorRegistry()
            registry.register(TelemetryCollector(pub, model_name="tiny", engine=0))
            text = generate_latest(registry).decode()
    finally:
        last.close()
        pub.close()
        ctx.term()
    perf = body["perf"]
    assert {k: v for k, v in perf.items() if k.endswith("_total")} == {
        "flops_total": flops, "read_bytes_total": sum(step_perf(TINY, s)[1] for s in steps),
        "write_bytes_total": sum(step_perf(TINY, s)[2] for s in steps)}
    res = body["kv_residency"]
    assert res["lifetime_s"]["bounds"] == [*RESIDENCY_BUCKETS, math.inf]
    fams = families(text)
    for name in RESIDENCY:
        assert fams[name].type == "histogram"
        assert [le for le, _ in buckets(fams, name)] == VLLM_LE, name
    lifetime = dict(buckets(fams, "vllm:kv_block_lifetime_seconds"))
    assert (lifetime["2.0"], lifetime["5.0"], lifetime["600.0"], lifetime["1200.0"]) == (0, 1, 1, 2)
    assert value(fams, "vllm:kv_block_lifetime_seconds_sum") == 702.5
    idle = dict(buckets(fams, "vllm:kv_block_idle_before_evict_seconds"))
    assert (idle["0.002"], idle["0.005"], idle["30.0"], idle["+Inf"]) == (0, 1, 2, 2)
    gaps = dict(buckets(fams, "vllm:kv_block_reuse_gap_seconds"))
    assert (gaps["0.5"], gaps["2.0"], gaps["1200.0"], gaps["1800.0"]) == (1, 2, 2, 3)
    assert [value(fams, n) for n in PERF] == [perf["flops_total"], perf["read_bytes_total"],
                                              perf["write_bytes_total"]]
    sample = next(s for s in fams["vllm:estimated_flops_per_gpu"].samples)
    assert sample.labels == {"model_name": "tiny", "engine": "0"}


def test_without_the_flags_no_such_series_exist() -> None:
    ctx = zmq.Context()
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-0", 0, EngineConfig(**FAST),
                             kv_format=KVFormat("float32", 4096, dims=TINY))
    pub.start()
    last = Last(pub.endpoint)
    try:
        last.wait_for("health", lambda b: True)     # subscribed: the one step window reaches us
        pub.record_step(step([(0, 10)]))
        body = last.wait_for("step", lambda b: b["iteration_tokens"]["count"] == 1)
    finally:
        last.close()
        pub.close()
        ctx.term()
    assert "perf" not in body and "kv_residency" not in body


# --- a real engine ------------------------------------------------------------------------------

ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "8", "--block-size", "8",
               "--max-num-seqs", "1", "--metrics-port", "0", "--kv-cache-metrics",
               "--kv-cache-metrics-sample", "1", "--enable-mfu-metrics",
               "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.2"]


@pytest.mark.proc
@pytest.mark.slow
def test_a_live_engine_samples_evicted_blocks_and_counts_each_steps_flops() -> None:
    """Six requests of 10 prompt + 3 output tokens, one at a time, on a pool of 8 blocks of 8:
    each takes 2 blocks, so the 5th and 6th reuse blocks the first ones held (evictions); each
    runs the steps (start 0, n 10), (10, 1), (11, 1)."""
    eng = EngineProcess(ENGINE_ARGS).start()
    try:
        last = Last(eng.endpoints["telemetry"])
        try:
            with EngineClient(eng.endpoints["input"], eng.endpoints["output"]) as client:
                ids = [client.submit(prompt_token_ids=[30 + 10 * i + j for j in range(10)],
                                     max_tokens=3, ignore_eos=True) for i in range(6)]
                done = client.gather(ids, timeout_s=120)
            assert all(len(c.output_token_ids) == 3 for c in done.values())
            per_request = [step_perf(TINY, step(rows)) for rows in
                           ([(0, 10)], [(10, 1)], [(11, 1)])]
            flops = 6 * sum(p[0] for p in per_request)
            # Idle: the loop handed over its last samples before it blocked.
            last.wait_for("health", lambda b: b["state"] == "idle" and b["steps"] >= 18)
            body = last.wait_for("step", lambda b: b.get("perf", {}).get("flops_total") == flops
                                 and b["kv_residency"]["lifetime_s"]["count"] > 0)
            fams = families(urllib.request.urlopen(eng.ready["metrics"], timeout=10)
                            .read().decode())
            again = last.wait_for("step", lambda b: b["seq"] > body["seq"])
        finally:
            last.close()
    finally:
        eng.stop()
    totals = ("flops_total", "read_bytes_total", "write_bytes_total")
    assert again["kv_residency"] == body["kv_residency"]
    assert [again["perf"][k] for k in totals] == [body["perf"][k] for k in totals]
    assert body["perf"]["read_bytes_total"] == 6 * sum(p[1] for p in per_request)
    assert body["perf"]["write_bytes_total"] == 6 * sum(p[2] for p in per_request)
    assert value(fams, "vllm:estimated_flops_per_gpu_total") == flops
    lifetime = body["kv_residency"]["lifetime_s"]
    assert 1 <= lifetime["count"] <= 4     # the 5th and 6th requests' 4 blocks, at most
    assert body["kv_residency"]["idle_before_evict_s"]["count"] == lifetime["count"]
    for name in RESIDENCY:
        assert [le for le, _ in buckets(fams, name)] == VLLM_LE, name
    assert value(fams, "vllm:kv_block_lifetime_seconds_count") == lifetime["count"]
