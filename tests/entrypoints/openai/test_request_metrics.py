"""vLLM's per-request size histograms on `vconsole serve`'s /metrics: prompt and generation
lengths, ``max_tokens``, ``n`` and the prefill tokens the prefix cache did not serve, observed as
each request's samples finish; and vLLM's per-request timings in the response
(`--enable-per-request-metrics`). The server runs over the session's engine, driven by the real
`openai` SDK."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from support.serve_process import free_port
from vconsole.entrypoints.openai.api_server import build_app
from vconsole.entrypoints.openai.engine_link import EngineLink
from vconsole.entrypoints.openai.request_metrics import (
    RequestSizeMetrics,
    one_two_five,
    per_request_timing,
)
from vconsole.entrypoints.openai.serving_base import OpenAIServing


def samples(text: str) -> dict[tuple[str, str], float]:
    """``{(sample name, le or ""): value}`` of the ``vllm:request_*`` families."""
    return {(s.name, s.labels.get("le", "")): s.value
            for f in text_string_to_metric_families(text) if f.name.startswith("vllm:request_")
            for s in f.samples}


def test_bounds_are_vllms_one_two_five_series_up_to_the_model_length() -> None:
    assert one_two_five(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_n_samples_count_as_n_requests_and_n_once() -> None:
    registry = CollectorRegistry()
    m = RequestSizeMetrics(registry)
    m.observe("tiny", 256, num_prompt_tokens=30, max_tokens=8, generation_tokens=[8, 3],
              cached_tokens=[16, 24])
    s = samples(generate_latest(registry).decode())
    assert s[("vllm:request_prompt_tokens_count", "")] == 2
    assert s[("vllm:request_prompt_tokens_sum", "")] == 60
    assert s[("vllm:request_generation_tokens_sum", "")] == 11
    assert s[("vllm:request_params_max_tokens_sum", "")] == 16
    assert s[("vllm:request_params_n_count", "")] == 1 and s[("vllm:request_params_n_sum", "")] == 2
    assert s[("vllm:request_prefill_kv_computed_tokens_sum", "")] == 14 + 6
    assert s[("vllm:request_prefill_kv_computed_tokens_bucket", "5.0")] == 0
    assert s[("vllm:request_prefill_kv_computed_tokens_bucket", "10.0")] == 1
    assert s[("vllm:request_prefill_kv_computed_tokens_bucket", "200.0")] == 2
    assert ("vllm:request_prompt_tokens_bucket", "500.0") not in s    # bounds end at 256


@pytest.fixture(scope="module")
def server_port(shared_engine: Any) -> Iterator[int]:
    port = free_port()
    serving = OpenAIServing(EngineLink(shared_engine.endpoints["input"],
                                       shared_engine.endpoints["output"]), model_name="tiny")
    serving.per_request_metrics = True
    app = build_app(serving, engine_metrics_url=shared_engine.ready.get("metrics"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server not up"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(30)


@pytest.mark.proc
def test_the_servers_metrics_count_each_finished_requests_sizes(server_port: int) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server_port}/v1", api_key="x",
                           max_retries=0)
    prompt = list(range(3, 43))                                  # 40 tokens, 5 blocks of 8
    for _ in range(2):                 # the second finds the first's full blocks cached
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 10
    with urllib.request.urlopen(f"http://127.0.0.1:{server_port}/metrics", timeout=30) as resp:
        s = samples(resp.read().decode())
    assert s[("vllm:request_prompt_tokens_count", "")] == 4
    assert s[("vllm:request_prompt_tokens_sum", "")] == 4 * 40
    assert s[("vllm:request_generation_tokens_sum", "")] == 4 * 5
    assert s[("vllm:request_params_max_tokens_sum", "")] == 4 * 5
    assert s[("vllm:request_params_n_count", "")] == 2
    computed = s[("vllm:request_prefill_kv_computed_tokens_sum", "")]
    assert 40 <= computed < 4 * 40        # the prefix cache served part of the later prompts


def test_per_request_timing_is_vllms_arithmetic_on_the_engines_phases() -> None:
    # vLLM's own example: queued 1.0, scheduled 1.5, first token 2.0, last 3.0, 10 tokens
    timings = {"queue_s": 0.5, "prefill_s": 0.5, "decode_s": 1.0, "inference_s": 1.5}
    m = per_request_timing(timings, 10)
    assert m["time_to_first_token_ms"] == pytest.approx(500.0)
    assert m["generation_time_ms"] == pytest.approx(1000.0)
    assert m["queue_time_ms"] == pytest.approx(500.0)
    assert m["mean_itl_ms"] == pytest.approx(1000.0 / 9)
    assert m["tokens_per_second"] == pytest.approx(10 / 1.5)
    assert per_request_timing(timings, 1)["mean_itl_ms"] is None
    assert set(per_request_timing({}, 3).values()) == {None}     # never scheduled


@pytest.mark.proc
def test_per_request_metrics_ride_on_one_sample_responses_only(server_port: int) -> None:
    base = f"http://127.0.0.1:{server_port}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    keys = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
            "tokens_per_second"}
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6,
                                  extra_body={"ignore_eos": True})
    metrics = r.model_extra["metrics"]            # type: ignore[index]
    assert set(metrics) == keys
    assert metrics["queue_time_ms"] >= 0 and metrics["time_to_first_token_ms"] > 0
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 5)
    assert metrics["tokens_per_second"] > 0
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [set(c.model_extra or {}) & {"metrics"} for c in chunks[:-1]] == [set()] * (
        len(chunks) - 1)                          # only the final usage chunk carries them
    assert chunks[-1].usage is not None and set(chunks[-1].model_extra["metrics"]) == keys
    two = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, n=2)
    assert "metrics" not in (two.model_extra or {})
