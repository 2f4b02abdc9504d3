"""SGLang's ``/metrics`` (a stand-in with SGLang's own names, label sets and buckets) read into
the console's messages: every figure equals what the server exposes."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from support.sglang_metrics import TTFT_BUCKETS, SglangMetrics
from vconsole.console.sources.sglang import SglangTranslator, parse
from vconsole.console.sources.vllm_metrics import quantile
from vconsole.telemetry.schema import decode


def bodies(frames):
    return {m.topic: m.payload for m in map(decode, frames)}


def test_queues_kv_prefix_and_retractions_are_sglangs_own_numbers():
    sg = SglangMetrics(max_total_num_tokens=100_000)
    sg.step(running=3, waiting=9, used_tokens=25_000, prompt=1000, cached=400, generation=500,
            finished=4, retracted=2, streaming=True)
    sg.step(running=3, waiting=9, used_tokens=25_000, prompt=600, generation=100, finished=1,
            streaming=False)                     # the other is_streaming label set
    t = SglangTranslator("sg")
    b = bodies(t.translate(sg.text(), now=100.0))
    assert b["health"]["model"] == sg.model
    assert (b["sched"]["num_running"], b["sched"]["num_waiting"]) == (3, 9)
    assert b["sched"]["num_preemptions_total"] == 2
    assert b["sched"]["num_prompt_tokens_total"] == 1600       # summed over is_streaming
    assert b["kv"]["usage"] == 0.25 and b["kv"]["capacity_tokens"] == 100_000
    assert b["kv"]["prefix_hit_rate"] == 400 / 1600
    assert b["health"]["source"] == "sglang"


def test_ttft_is_the_histogram_sglang_exposes_with_its_bounds():
    sg = SglangMetrics()
    sg.step(running=1, waiting=0, used_tokens=10, finished=7, ttft=0.5)
    sg.step(running=1, waiting=0, used_tokens=10, finished=3, ttft=3.0, streaming=False)
    (eng,) = parse(sg.text()).values()
    h = eng.histograms["vllm:time_to_first_token_seconds"]
    assert h.bounds == [*map(float, TTFT_BUCKETS), math.inf]
    assert h.count == 10
    # the same as the server's own buckets summed over is_streaming
    own = {}
    for fam in text_string_to_metric_families(sg.text()):
        if fam.name == "sglang:time_to_first_token_seconds":
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                    own[le] = own.get(le, 0) + s.value
    assert h.counts == [own[b] for b in h.bounds]
    b = bodies(SglangTranslator("sg", window_s=0).translate(sg.text(), now=1.0))
    assert b["latency"]["overall"]["window"]["ttft_s"]["p50"] == quantile(0.5, h.bounds, h.counts)


def test_a_tensor_parallel_rank_above_zero_does_not_double_the_queues():
    sg = SglangMetrics()
    sg.step(running=4, waiting=2, used_tokens=10)
    sg.running.labels(**{**sg.sched, "tp_rank": "1"}).set(4)
    (eng,) = parse(sg.text()).values()
    assert eng.get("vllm:num_requests_running") == 4
