"""Prometheus export: ``/metrics`` says exactly what the telemetry stream last said.

The collector is checked on payloads built by the publisher's own body functions; the publisher's
new cumulative ``step`` fields and a scrape against its last messages over real PUB/SUB and HTTP
sockets; then a live `vconsole engine --metrics-port 0` (under its supervisor) is scraped while
its telemetry is watched, and its engine process is killed to see the port come back.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vconsole.engine.client.client import EngineClient
from vconsole.engine.latency import (
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    LatencyLog,
    LatencyStats,
)
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.process.core_proc import EngineCoreProc
from vconsole.engine.publish.bodies import KVFormat, kv_body, sched_body
from vconsole.engine.publish.inbox import ITERATION_TOKENS_BUCKETS
from vconsole.engine.publish.prometheus import MetricsServer, RanksCollector, TelemetryCollector
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.security.bind_policy import RemoteBindRefused, check_metrics_host
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, SchedulerStats, StepStats
from vconsole.telemetry import schema
from vconsole.telemetry.alerts import RULES
from vconsole.telemetry.listener import TelemetryListener
from vconsole.wire.ready_file import read_ready_file

LABELS = {"model_name": "tiny", "engine": "0"}
VLLM_NAMES = {   # family name (as the parser reports it) -> type
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
VCONSOLE_NAMES = {
    "vconsole:num_requests_preempted": "gauge",
    "vconsole:kv_block_usage_perc": "gauge",
    "vconsole:kv_token_usage_perc": "gauge",
    "vconsole:kv_fragmentation": "gauge",
    "vconsole:kv_blocks": "gauge",
    "vconsole:kv_cache_bytes_per_token": "gauge",
    "vconsole:kv_cache_capacity_tokens": "gauge",
    "vconsole:step_phase_seconds": "counter",
    "vconsole:scheduler_share": "gauge",
    "vconsole:step_time_p50_seconds": "gauge",
    "vconsole:gpu_memory_used_bytes": "gauge",
    "vconsole:gpu_memory_total_bytes": "gauge",
    "vconsole:gpu_utilization_perc": "gauge",
    "vconsole:alert_level": "gauge",
    "vconsole:engine_restarts": "counter",
    "vconsole:telemetry_errors": "counter",
    "vconsole:engine_up": "gauge",
    "vconsole:config_version": "gauge",
    "vconsole:structured_output_requests_compiling": "gauge",
    "vconsole:structured_output_compiles": "counter",
    "vconsole:structured_output_compile_cache_hits": "counter",
    "vconsole:structured_output_compile_errors": "counter",
    "vconsole:structured_output_compile_seconds": "counter",
}


# --- helpers ---------------------------------------------------------------------------------

class Scrape:
    """One exposition, parsed: ``families[name]`` and ``value(sample name, **labels)``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str) -> list[Any]:
        return [s for f in self.families.values() for s in f.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        hits = [s.value for s in self.samples(name)
                if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    def buckets(self, name: str) -> list[tuple[float, float]]:
        return [(float(s.labels["le"]), s.value) for s in self.samples(f"{name}_bucket")]


def scrape_collector(collector: TelemetryCollector) -> Scrape:
    registry = CollectorRegistry()
    registry.register(collector)
    return Scrape(generate_latest(registry).decode())


def scrape_url(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return Scrape(resp.read().decode())


class Bodies:
    """A stand-in for the publisher: ``last_bodies`` returns these payloads."""

    def __init__(self, bodies: dict[str, dict[str, Any]]) -> None:
        self.bodies = bodies

    def last_bodies(self) -> dict[str, dict[str, Any]]:
        return dict(self.bodies)


def hand_made_bodies() -> dict[str, dict[str, Any]]:
    sched = SchedulerStats(num_waiting=7, num_running=3, num_preempted=2,
                           num_preemptions_total=11, max_num_seqs=8,
                           max_num_batched_tokens=256, policy="fcfs", num_finished_total=40,
                           num_prompt_tokens_total=1234, num_generation_tokens_total=567,
                           num_compiling=2, structured_compiles_total=9,
                           structured_compile_cache_hits_total=30,
                           structured_compile_errors_total=1,
                           structured_compile_seconds_total=0.125)
    kv = KVStats(num_blocks=64, block_size=16, num_free=40, num_used=20, num_cached=4,
                 num_shared=5, usage=20 / 64, token_usage=0.27, fragmentation=0.125,
                 prefix_queries=900, prefix_hits=300, block_states=np.zeros(64, np.uint8))
    lat = LatencyStats(60.0)
    for v in (0.0005, 0.03, 0.03, 3.0):
        lat.observe("ttft_s", v, priority=0, now=10.0)
    lat.observe("itl_s", 0.02, priority=5, now=10.0, times=9)
    for name in ("e2e_s", "queue_s", "prefill_s", "decode_s", "inference_s"):
        lat.observe(name, 0.7, priority=0, now=10.0)
    lat.finish("stop")
    lat.finish("stop")
    lat.finish("length")
    step_body = {
        "steps": 0, "sched_share": 0.04, "step_time_p50_s": 0.0625,
        "iteration_tokens": {"bounds": [*ITERATION_TOKENS_BUCKETS, math.inf],
                             "counts": [2, 5, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 10],
                             "count": 10, "sum": 40_000},
        "phase_s_total": {"schedule": 0.5, "execute": 12.25, "update": 0.75},
    }
    return {
        "sched": sched_body(sched, max_rows=0),
        "kv": kv_body(kv, KVFormat("int8_per_token_head", 1088)),
        "latency": lat.snapshot(10.0), "step": step_body,
        "health": {"state": "idle", "alerts_active": {"waiting": "critical",
                                                      "fragmentation": "warning"},
                   "restart_count": 2, "telemetry_errors": 3},
        "config": {"version": 6, "values": {}, "schema": []},
        "gpu": {"available": True, "error": None, "devices": [
            {"index": 0, "util": 50.0, "mem_used": 6 << 30, "mem_total": 8 << 30},
            {"index": 1, "util": None, "mem_used": 1 << 30, "mem_total": 8 << 30}]},
    }


# --- the collector on hand-made payloads -----------------------------------------------------

def test_every_metric_has_its_vllm_or_vconsole_name_type_and_both_labels():
    scrape = scrape_collector(TelemetryCollector(Bodies(hand_made_bodies()), model_name="tiny",
                                                 engine=0))
    for name, kind in {**VLLM_NAMES, **VCONSOLE_NAMES}.items():
        fam = scrape.families.get(name)
        assert fam is not None, f"{name} missing"
        assert fam.type == kind, name
        assert fam.samples and all(s.labels.items() >= LABELS.items() for s in fam.samples), name
    # vLLM's config info gauge: engine label, no model_name (as vLLM), the cache config as labels
    info = scrape.families["vllm:cache_config_info"]
    assert info.type == "gauge" and [s.value for s in info.samples] == [1.0]
    labels = info.samples[0].labels
    assert labels["engine"] == "0" and "model_name" not in labels
    assert labels["num_gpu_blocks"] == str(hand_made_bodies()["kv"]["num_blocks"])
    assert labels["block_size"] == str(hand_made_bodies()["kv"]["block_size"])
    assert set(scrape.families) == {*VLLM_NAMES, *VCONSOLE_NAMES, "vllm:cache_config_info"}
    assert "vllm:prompt_tokens_total" in scrape.text      # counters carry _total
    assert "vllm:iteration_tokens_total_bucket" in scrape.text


def test_gauges_and_counters_equal_the_payload_fields():
    bodies = hand_made_bodies()
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    sched, kv = bodies["sched"], bodies["kv"]
    assert s.value("vllm:num_requests_running") == sched["num_running"] == 3
    assert s.value("vllm:num_requests_waiting") == 7
    assert s.value("vconsole:num_requests_preempted") == 2
    assert s.value("vllm:num_preemptions_total") == 11
    assert s.value("vllm:prompt_tokens_total") == 1234
    assert s.value("vllm:generation_tokens_total") == 567
    assert s.value("vllm:kv_cache_usage_perc") == kv["usage"] == 20 / 64
    assert s.value("vconsole:kv_block_usage_perc") == 20 / 64
    assert s.value("vconsole:kv_token_usage_perc") == 0.27
    assert s.value("vconsole:kv_fragmentation") == 0.125
    assert s.value("vllm:prefix_cache_queries_total") == 900
    assert s.value("vllm:prefix_cache_hits_total") == 300
    assert {st: s.value("vconsole:kv_blocks", state=st)
            for st in ("free", "used", "cached", "shared")} == {
        "free": 40, "used": 20, "cached": 4, "shared": 5}
    assert s.value("vllm:request_success_total", finished_reason="stop") == 2
    assert s.value("vllm:request_success_total", finished_reason="length") == 1
    assert {p: s.value("vconsole:step_phase_seconds_total", phase=p)
            for p in ("schedule", "execute", "update")} == {
        "schedule": 0.5, "execute": 12.25, "update": 0.75}
    assert s.value("vconsole:scheduler_share") == 0.04
    assert s.value("vconsole:structured_output_requests_compiling") == 2
    assert s.value("vconsole:structured_output_compiles_total") == 9
    assert s.value("vconsole:structured_output_compile_cache_hits_total") == 30
    assert s.value("vconsole:structured_output_compile_errors_total") == 1
    assert s.value("vconsole:structured_output_compile_seconds_total") == 0.125
    levels = {n: s.value("vconsole:alert_level", alert=n) for n in RULES}
    assert levels == {**dict.fromkeys(RULES, 0.0), "waiting": 2.0, "fragmentation": 1.0}
    assert s.value("vconsole:engine_restarts_total") == 2
    assert s.value("vconsole:config_version") == 6
    assert s.value("vconsole:kv_cache_bytes_per_token") == kv["bytes_per_token"] == 1088
    assert s.value("vconsole:kv_cache_capacity_tokens") == 64 * 16
    assert s.value("vconsole:step_time_p50_seconds") == 0.0625
    # vLLM's waiting split: the queue is 'capacity'; a compiling grammar is 'deferred'
    assert s.value("vllm:num_requests_waiting_by_reason", reason="capacity") == 7
    assert s.value("vllm:num_requests_waiting_by_reason", reason="deferred") == 2
    assert s.value("vconsole:gpu_memory_used_bytes", device="0") == 6 << 30
    assert s.value("vconsole:gpu_memory_total_bytes", device="1") == 8 << 30
    assert s.value("vconsole:gpu_utilization_perc", device="0") == 0.5
    assert not s.samples("vconsole:gpu_utilization_perc") or all(
        x.labels["device"] == "0" for x in s.samples("vconsole:gpu_utilization_perc"))


def test_every_finish_reason_is_exposed_at_zero_before_any_request_finishes():
    """As vLLM creates its label sets up front: a series born at its first value would hide
    that many finishes from rate() and increase() (Prometheus sees no increase into it)."""
    bodies = {**hand_made_bodies(), "latency": LatencyStats(60.0).snapshot(10.0)}
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    assert {x.labels["finished_reason"]: x.value for x in s.samples("vllm:request_success_total")
            } == {"length": 0, "stop": 0, "abort": 0, "timeout": 0, "error": 0}
    s = scrape_collector(TelemetryCollector(Bodies(hand_made_bodies()), model_name="tiny",
                                            engine=0))
    assert s.value("vllm:request_success_total", finished_reason="abort") == 0


def test_a_machine_without_nvml_exports_no_gpu_series():
    bodies = {**hand_made_bodies(),
              "gpu": {"available": False, "devices": [], "error": "no NVIDIA driver"}}
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    assert not [n for n in s.families if n.startswith("vconsole:gpu_")]


def _cache_dtype_label(bodies: dict[str, dict[str, Any]]) -> str:
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    return s.families["vllm:cache_config_info"].samples[0].labels["cache_dtype"]


def test_cache_config_info_names_the_configured_kv_cache_dtype_as_vllm_does():
    bodies = hand_made_bodies()
    # vLLM's label is the configured dtype: auto stays auto, an alias is spelled out
    bodies["config"]["values"] = {"kv_cache_dtype": "int8", "dtype": "float32"}
    assert _cache_dtype_label(bodies) == "int8_per_token_head"
    bodies["config"]["values"] = {"kv_cache_dtype": "auto", "dtype": "float32"}
    assert _cache_dtype_label(bodies) == "auto"
    # a config that names none (an older engine's): what its pool stores, else auto
    bodies["config"]["values"] = {}
    assert _cache_dtype_label(bodies) == "int8_per_token_head"
    bodies["kv"] = {k: v for k, v in bodies["kv"].items() if k != "cache_dtype"}
    assert _cache_dtype_label(bodies) == "auto"


def test_an_engine_without_kv_format_fields_has_no_kv_size_series():
    bodies = hand_made_bodies()
    for key in ("cache_dtype", "bytes_per_token", "capacity_tokens", "pool_bytes"):
        del bodies["kv"][key]
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    assert "vconsole:kv_cache_bytes_per_token" not in s.families
    assert "vconsole:kv_cache_capacity_tokens" not in s.families
    assert s.value("vllm:kv_cache_usage_perc") == 20 / 64


def test_histograms_are_the_payloads_cumulative_buckets_with_vllms_bounds():
    bodies = hand_made_bodies()
    s = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=0))
    ttft = bodies["latency"]["overall"]["histograms"]["ttft_s"]
    got = s.buckets("vllm:time_to_first_token_seconds")
    assert [le for le, _ in got] == [*TTFT_BUCKETS, math.inf]
    assert [c for _, c in got] == ttft["counts"]
    assert got[0][1] == 1 and got[-1][1] == 4          # 0.0005 <= 0.001; all four
    assert s.value("vllm:time_to_first_token_seconds_count") == ttft["count"] == 4
    assert s.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(3.0605)
    assert s.value("vllm:inter_token_latency_seconds_count") == 9
    e2e = s.buckets("vllm:e2e_request_latency_seconds")
    assert [le for le, _ in e2e] == [*REQUEST_LATENCY_BUCKETS, math.inf]
    it = s.buckets("vllm:iteration_tokens_total")
    assert [le for le, _ in it] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384, math.inf]
    assert [c for _, c in it] == bodies["step"]["iteration_tokens"]["counts"]
    assert s.value("vllm:iteration_tokens_total_count") == 10
    assert s.value("vllm:iteration_tokens_total_sum") == 40_000


def test_labels_name_the_model_and_the_engine_rank():
    s = scrape_collector(TelemetryCollector(Bodies(hand_made_bodies()),
                                            model_name="/models/llama", engine=3))
    assert s.value("vllm:num_requests_running", model_name="/models/llama", engine="3") == 3


def test_a_topic_not_heard_yet_contributes_no_metric():
    bodies = hand_made_bodies()
    only_kv = scrape_collector(TelemetryCollector(Bodies({"kv": bodies["kv"]}),
                                                  model_name="tiny"))
    assert "vllm:kv_cache_usage_perc" in only_kv.families
    assert "vllm:num_requests_running" not in only_kv.families
    assert scrape_collector(TelemetryCollector(Bodies({}), model_name="tiny")).families == {}
    old_sched = {k: v for k, v in bodies["sched"].items()
                 if k not in ("num_prompt_tokens_total", "num_generation_tokens_total")}
    older = scrape_collector(TelemetryCollector(Bodies({"sched": old_sched}), model_name="t"))
    assert "vllm:num_requests_running" in older.families
    assert "vllm:prompt_tokens" not in older.families


# --- data parallel: every rank's series, engine="<rank>" -------------------------------------

DP_NAMES = {
    "vconsole:dp_world_size": "gauge", "vconsole:dp_wave": "gauge",
    "vconsole:dp_wave_running": "gauge", "vconsole:dp_group_generation": "gauge",
    "vconsole:dp_group_state": "gauge", "vconsole:dp_steps": "counter",
    "vconsole:dp_dummy_steps": "counter", "vconsole:dp_dummy_share": "gauge",
    "vconsole:dp_syncs": "counter", "vconsole:dp_sync_seconds": "counter",
    "vconsole:dp_sync_seconds_per_step": "gauge",
}


def two_rank_bodies() -> dict[int, dict[str, dict[str, Any]]]:
    """Rank 0 busy in wave 3; rank 1 idle in the same wave, running dummy steps."""
    r0, r1 = hand_made_bodies(), hand_made_bodies()
    r1["sched"] = {**r1["sched"], "num_running": 0, "num_waiting": 0,
                   "num_preemptions_total": 1}
    r1["kv"] = {**r1["kv"], "usage": 0.0}
    r1["health"] = {"state": "idle", "alerts_active": {}}
    dp = {"world_size": 2, "wave": 3, "wave_running": True, "group_generation": 1,
          "group_state": "ok", "steps_total": 400, "dummy_steps_total": 0, "dummy_share": 0.0,
          "sync_every": 4, "sync_count_total": 100, "sync_s_total": 0.05,
          "sync_s_per_step": 0.000125}
    r0["dp"] = dp
    r1["dp"] = {**dp, "dummy_steps_total": 120, "dummy_share": 0.3, "group_state": "broken",
                "sync_s_total": 0.07}
    return {0: r0, 1: r1}


def test_a_data_parallel_scrape_labels_every_rank_and_adds_the_dp_series():
    ranks = two_rank_bodies()
    s = scrape_collector(RanksCollector(lambda: ranks, model_name="tiny"))
    # One family per name (HELP and TYPE once), each with both ranks' samples.
    assert s.text.count("# TYPE vllm:num_requests_running gauge") == 1
    for name, kind in {**VLLM_NAMES, **VCONSOLE_NAMES, **DP_NAMES}.items():
        fam = s.families.get(name)
        assert fam is not None and fam.type == kind, name
        assert {smp.labels["engine"] for smp in fam.samples} >= {"0", "1"} or \
            name in ("vconsole:engine_restarts", "vconsole:telemetry_errors"), name
    assert s.value("vllm:num_requests_running", engine="0") == 3
    assert s.value("vllm:num_requests_running", engine="1") == 0
    assert s.value("vllm:num_preemptions_total", engine="1") == 1
    assert s.value("vconsole:alert_level", engine="1", alert="waiting") == 0
    assert s.value("vconsole:alert_level", engine="0", alert="waiting") == 2
    assert s.value("vconsole:dp_wave", engine="1") == 3
    assert s.value("vconsole:dp_wave_running", engine="0") == 1
    assert s.value("vconsole:dp_dummy_steps_total", engine="0") == 0
    assert s.value("vconsole:dp_dummy_steps_total", engine="1") == 120
    assert s.value("vconsole:dp_dummy_share", engine="1") == 0.3
    assert s.value("vconsole:dp_sync_seconds_total", engine="1") == 0.07
    assert s.value("vconsole:dp_syncs_total", engine="0") == 100
    assert {st: s.value("vconsole:dp_group_state", engine="1", state=st)
            for st in ("none", "forming", "ok", "broken")} == {
        "none": 0, "forming": 0, "ok": 0, "broken": 1}
    assert all(smp.labels["model_name"] == "tiny" for f in s.families.values()
               for smp in f.samples if f.name != "vllm:cache_config_info")   # vLLM's: no name


def test_the_single_engine_collector_is_the_one_rank_case():
    bodies = hand_made_bodies()
    one = scrape_collector(TelemetryCollector(Bodies(bodies), model_name="tiny", engine=2))
    ranks = scrape_collector(RanksCollector(lambda: {2: bodies}, model_name="tiny"))
    assert one.text == ranks.text
    assert not any(n.startswith("vconsole:dp_") for n in one.families)   # no dp topic


def test_a_rank_not_heard_yet_contributes_nothing_and_ranks_come_in_order():
    ranks = two_rank_bodies()
    s = scrape_collector(RanksCollector(lambda: {1: ranks[1], 0: {}, 10: ranks[0]},
                                        model_name="tiny"))
    engines = [smp.labels["engine"] for smp in s.samples("vllm:num_requests_running")]
    assert engines == ["1", "10"]


# --- the publisher: cumulative step fields, and a scrape against its last messages -----------

FAST = dict(telemetry_hz=20.0, heartbeat_interval_s=0.1, config_interval_s=0.3)



@pytest.fixture
def publisher(ctx):
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-0", 0, EngineConfig(**FAST))
    pub.start()
    yield pub
    pub.close()
    assert pub.error is None


class Subscriber:
    """Every message of one publisher, decoded, from a SUB thread; ``last(topic)``."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on_message)

    def _on_message(self, msg: schema.TelemetryMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, msg.payload))

    def last(self, topic: str) -> dict[str, Any] | None:
        with self._lock:
            return next((p for t, p in reversed(self.messages) if t == topic), None)

    def wait_for(self, topic: str, pred: Any = lambda p: True,
                 timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.last(topic)
            if last is not None and pred(last):
                return last
            time.sleep(0.02)
        raise AssertionError(f"no {topic} message matched within {timeout_s} s "
                             f"(last: {self.last(topic)})")

    def close(self) -> None:
        self._listener.close(None)


def without_envelope(body: dict[str, Any]) -> dict[str, Any]:
    """A payload without what changes from one repeat of a message to the next."""
    return {k: v for k, v in body.items() if k not in ("seq", "ts", "window_s", "block_states")}


def step_stats(tokens: int, schedule_ns: int = 1_000, execute_ns: int = 20_000,
               update_ns: int = 3_000) -> StepStats:
    return StepStats(schedule_ns=schedule_ns, execute_ns=execute_ns, update_ns=update_ns,
                     total_ns=schedule_ns + execute_ns + update_ns, num_prefill_tokens=tokens,
                     num_decode_tokens=0, num_reqs=1)


def test_the_step_topic_carries_cumulative_tokens_per_step_and_phase_seconds(publisher):
    sub = Subscriber(publisher.endpoint)
    try:
        sub.wait_for("health")
        tokens = [1, 8, 9, 16384, 16385, 40]   # bounds are inclusive: 1 and 8 fall on them
        for n in tokens:
            publisher.record_step(step_stats(n))
        first = sub.wait_for("step", lambda p: p["iteration_tokens"]["count"] == len(tokens))
        publisher.record_step(step_stats(3, schedule_ns=2_000_000_000))
        body = sub.wait_for("step", lambda p: p["iteration_tokens"]["count"] == 7)
    finally:
        sub.close()
    h = first["iteration_tokens"]
    assert h["bounds"] == [*ITERATION_TOKENS_BUCKETS, math.inf]
    per_bucket = np.diff([0, *h["counts"]]).tolist()
    assert per_bucket == [1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1]   # 13 bounds, +Inf
    assert h["sum"] == sum(tokens) and h["counts"][-1] == h["count"]
    # cumulative: a later message holds every step so far, not only its own window's
    assert body["steps"] <= 1 and body["iteration_tokens"]["sum"] == sum(tokens) + 3
    assert body["phase_s_total"] == pytest.approx(
        {"schedule": 2.0 + 6 * 1e-6, "execute": 7 * 2e-5, "update": 7 * 3e-6,
         "structured": 0.0})


def test_a_scrape_over_http_equals_the_last_messages_the_publisher_sent(publisher):
    collector = TelemetryCollector(publisher, model_name="tiny", engine=0)
    server = MetricsServer(collector, "127.0.0.1", 0).start()
    sub = Subscriber(publisher.endpoint)
    try:
        sub.wait_for("health")
        sched = SchedulerStats(num_waiting=4, num_running=2, num_preempted=1,
                               num_preemptions_total=5, max_num_seqs=8,
                               max_num_batched_tokens=64, policy="fcfs",
                               num_prompt_tokens_total=321, num_generation_tokens_total=99)
        kv = KVStats(num_blocks=16, block_size=8, num_free=10, num_used=6, num_cached=0,
                     num_shared=0, usage=6 / 16, token_usage=0.3, fragmentation=0.2,
                     prefix_queries=50, prefix_hits=10, block_states=np.zeros(16, np.uint8))
        publisher.record_step(step_stats(24))
        publisher.submit_snapshot(sched, kv, "running", 1)
        lat = LatencyLog()
        lat.observe("ttft_s", 0.05, priority=0, now=1.0)
        publisher.submit_latency(lat.drain(1.0, 60.0))
        publisher.publish_config(3, {"max_num_seqs": 8})
        sub.wait_for("latency")
        sub.wait_for("config", lambda p: p["version"] == 3)
        # Nothing new is submitted: every topic repeats itself (the step window is empty).
        sub.wait_for("step", lambda p: p["steps"] == 0 and p["iteration_tokens"]["count"] == 1)
        before = {t: sub.wait_for(t) for t in ("sched", "kv", "latency", "step")}
        scrape = scrape_url(server.url)
        # Past a heartbeat: each topic sent again.
        last = {t: sub.wait_for(t, lambda p, t=t: p["seq"] > before[t]["seq"]) for t in before}
    finally:
        sub.close()
        server.close()
    for topic in before:
        assert last[topic]["seq"] > before[topic]["seq"], topic
        assert without_envelope(before[topic]) == without_envelope(last[topic]), topic
    assert scrape.value("vllm:num_requests_waiting") == last["sched"]["num_waiting"] == 4
    assert scrape.value("vllm:prompt_tokens_total") == last["sched"]["num_prompt_tokens_total"]
    assert scrape.value("vllm:prefix_cache_queries_total") == last["kv"]["prefix_queries"]
    assert scrape.value("vllm:kv_cache_usage_perc") == last["kv"]["usage"]
    ttft = last["latency"]["overall"]["histograms"]["ttft_s"]
    assert [c for _, c in scrape.buckets("vllm:time_to_first_token_seconds")] == ttft["counts"]
    it = last["step"]["iteration_tokens"]
    assert [c for _, c in scrape.buckets("vllm:iteration_tokens_total")] == it["counts"]
    assert scrape.value("vconsole:config_version") == 3
    assert scrape.value("vconsole:step_phase_seconds_total", phase="execute") == \
        last["step"]["phase_s_total"]["execute"]


# --- where it may bind -------------------------------------------------------------------------

def test_the_metrics_host_must_be_loopback_unless_remote_is_allowed():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_metrics_host(host, allow_remote=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "gpu-box.example"):
        with pytest.raises(RemoteBindRefused, match="--allow-remote-metrics"):
            check_metrics_host(host, allow_remote=False)
        check_metrics_host(host, allow_remote=True)


def test_an_engine_refuses_a_remote_metrics_host_before_it_binds_anything(tmp_path):
    endpoints = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    with pytest.raises(RemoteBindRefused):
        EngineCoreProc(EngineConfig(), endpoints, metrics_endpoint=("0.0.0.0", 0))
    assert list(tmp_path.iterdir()) == []   # no ipc socket was bound


@pytest.mark.proc
def test_vconsole_engine_exits_2_on_a_remote_metrics_host_without_the_flag(tmp_path):
    cmd = [sys.executable, "-m", "vconsole", "engine", "--no-supervisor",
           "--metrics-port", "0", "--metrics-host", "0.0.0.0",
           *(f"--{n}=ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry",
                                                     "control"))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert "--allow-remote-metrics" in done.stderr


# --- a live engine ---------------------------------------------------------------------------

ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "4", "--metrics-port", "0",
               "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.2",
               "--restart-backoff", "0.1"]


@pytest.fixture(scope="module")
def engine():
    eng = EngineProcess(ENGINE_ARGS).start()
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def served(engine):
    """Requests run to the end by one client; returns what that client received."""
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]   # one full shared block: prefix cache hits
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
        ids = [client.submit(prompt_token_ids=[*prefix, 20 + i, 21 + i], max_tokens=4 + i,
                             ignore_eos=True) for i in range(6)]
        done = client.gather(ids, timeout_s=120)
    return list(done.values())


@pytest.mark.proc
@pytest.mark.slow
def test_the_metrics_port_binds_loopback_by_default_and_is_in_the_ready_file(engine):
    url = engine.ready["metrics"]
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.path == "/metrics" and parts.port
    # The supervisor's port (it answers while the engine restarts, `metrics_relay`).
    listening = [c.laddr for c in psutil.Process(engine.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == parts.port]
    assert [a.ip for a in listening] == ["127.0.0.1"]
    scrape_url(url)   # answers 200 (even before any request)


@pytest.mark.proc
@pytest.mark.slow
def test_a_scrape_of_a_live_engine_equals_its_telemetry_and_what_clients_received(engine,
                                                                                   served):
    generated = sum(len(c.output_token_ids) for c in served)
    first_tokens = sum(1 for c in served if c.output_token_ids)
    assert all(c.finish_reason == "length" for c in served) and first_tokens == 6
    sub = Subscriber(engine.endpoints["telemetry"])
    try:
        # Quiesced: the engine is idle and the stream already holds every request.
        sub.wait_for("latency", lambda p: p["overall"]["histograms"]["ttft_s"]["count"] == 6)
        sub.wait_for("sched", lambda p: p["num_running"] == 0
                     and p["num_generation_tokens_total"] == generated)
        sub.wait_for("health", lambda p: p["state"] == "idle")
        sub.wait_for("step", lambda p: p["steps"] == 0)
        before = {t: sub.wait_for(t) for t in ("sched", "kv", "latency", "step", "config")}
        scrape = scrape_url(engine.ready["metrics"])
        # Past a heartbeat: every state topic is sent again (config only every 5 s).
        after = {t: sub.wait_for(t, lambda p, t=t: t == "config" or p["seq"] > before[t]["seq"])
                 for t in before}
    finally:
        sub.close()

    for name, kind in VLLM_NAMES.items():
        fam = scrape.families.get(name)
        assert fam is not None and fam.type == kind, name
        assert fam.samples and all(s.labels.get("model_name") == "tiny"
                                   and s.labels.get("engine") == "0" for s in fam.samples), name
    assert scrape.value("vllm:time_to_first_token_seconds_count") == first_tokens
    assert scrape.value("vllm:generation_tokens_total") == generated
    assert scrape.value("vllm:request_success_total", finished_reason="length") == 6
    assert scrape.value("vllm:prefix_cache_hits_total") > 0

    for topic in ("sched", "kv", "latency", "step"):  # the stream stood still around the scrape
        assert after[topic]["seq"] > before[topic]["seq"], topic
        assert without_envelope(after[topic]) == without_envelope(before[topic]), topic
    sched, kv, lat, step = (after[t] for t in ("sched", "kv", "latency", "step"))
    # ... and the scrape says what it says
    assert scrape.value("vllm:num_requests_running") == sched["num_running"]
    assert scrape.value("vllm:num_requests_waiting") == sched["num_waiting"]
    assert scrape.value("vllm:num_preemptions_total") == sched["num_preemptions_total"]
    assert scrape.value("vllm:prompt_tokens_total") == sched["num_prompt_tokens_total"] \
        == sum(c.num_prompt_tokens for c in served)
    assert scrape.value("vllm:generation_tokens_total") == sched["num_generation_tokens_total"]
    assert scrape.value("vllm:kv_cache_usage_perc") == kv["usage"]
    assert scrape.value("vllm:prefix_cache_queries_total") == kv["prefix_queries"]
    assert scrape.value("vllm:prefix_cache_hits_total") == kv["prefix_hits"]
    assert scrape.value("vconsole:kv_fragmentation") == kv["fragmentation"]
    for series, name in (("ttft_s", "vllm:time_to_first_token_seconds"),
                         ("itl_s", "vllm:inter_token_latency_seconds"),
                         ("e2e_s", "vllm:e2e_request_latency_seconds")):
        h = lat["overall"]["histograms"][series]
        assert [c for _, c in scrape.buckets(name)] == h["counts"], name
        assert scrape.value(f"{name}_sum") == h["sum"], name
    assert scrape.value("vllm:inter_token_latency_seconds_count") == generated - first_tokens
    it = step["iteration_tokens"]
    assert [c for _, c in scrape.buckets("vllm:iteration_tokens_total")] == it["counts"]
    computed_prompt = sum(c.num_prompt_tokens - c.num_cached_tokens for c in served)
    assert it["sum"] == computed_prompt + generated - first_tokens   # every decode after the first
    assert scrape.value("vconsole:config_version") == after["config"]["version"]


@pytest.mark.long   # make test-long: the relay's last values while down are the next test's
@pytest.mark.proc
@pytest.mark.slow
def test_a_restarted_engine_serves_metrics_on_the_same_port(engine, served):
    """While no engine process runs, /metrics answers with the last figures and
    ``vconsole:engine_up 0``; the restarted engine then serves on the same port."""
    url = engine.ready["metrics"]
    old_child = engine.ready["child_pid"]
    generated = sum(len(c.output_token_ids) for c in served)
    deadline = time.monotonic() + 30
    while scrape_url(url).value("vllm:generation_tokens_total") != generated:
        assert time.monotonic() < deadline, "the stream never caught up"
        time.sleep(0.1)     # the relay keeps this last good scrape
    assert scrape_url(url).value("vconsole:engine_up") == 1
    os.kill(old_child, signal.SIGKILL)
    deadline = time.monotonic() + 120
    down = None
    while time.monotonic() < deadline:
        s = scrape_url(url)
        if "vconsole:engine_up" in s.families and s.value("vconsole:engine_up") == 0:
            down = s    # the last one before the new engine answers
        record = read_ready_file(engine.ready_path)
        if record is not None and record.get("child_pid") not in (None, old_child):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the supervisor did not restart the engine")
    assert down is not None, "no scrape saw the engine down"
    assert down.value("vllm:generation_tokens_total") == generated, "the last values"
    assert down.value("vconsole:engine_restarts_total") == 1
    assert record["metrics"] == url and record["restart_count"] == 1
    scrape = None
    while time.monotonic() < deadline:
        try:
            scrape = scrape_url(url)
        except OSError:
            time.sleep(0.1)
            continue
        if {"vconsole:engine_restarts", "vllm:generation_tokens", "vconsole:engine_up"} \
                <= scrape.families.keys() and scrape.value("vconsole:engine_up") == 1:
            break   # the new engine's health and its first sched message were sent
        time.sleep(0.1)
    assert scrape is not None
    assert scrape.value("vconsole:engine_restarts_total") == 1
    assert scrape.value("vllm:generation_tokens_total") == 0   # a new engine process


def test_a_scrape_while_no_engine_answers_keeps_the_last_values_and_says_down():
    from vconsole.engine.launch.metrics_relay import mark_down

    last = ('vllm:generation_tokens_total{engine="0",model_name="tiny"} 42.0\n'
            'vconsole:engine_restarts_total{engine="0",model_name="tiny"} 0.0\n'
            'vconsole:engine_up{engine="0",model_name="tiny"} 1.0\n')
    down = mark_down(last, 3)
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 42.0' in down
    assert 'vconsole:engine_restarts_total{engine="0",model_name="tiny"} 3.0' in down
    assert 'vconsole:engine_up{engine="0",model_name="tiny"} 0.0' in down
    assert "vconsole:engine_up 0.0" in mark_down("", 1), "never scraped: still says down"
