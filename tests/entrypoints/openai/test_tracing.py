"""OpenTelemetry request traces (`vconsole serve --otlp-traces-endpoint`): the server over the
session's engine sends its spans, OTLP over HTTP/protobuf from the SDK's exporter, to a real OTLP
HTTP receiver (a local HTTP server decoding with `opentelemetry-proto`); requests come from the
real `openai` SDK with a caller's W3C ``traceparent``. A dead collector costs a counter on
/metrics, never a request."""

from __future__ import annotations

import gzip
import http.server
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn

from support.serve_process import free_port
from vconsole.entrypoints.openai.api_server import build_app
from vconsole.entrypoints.openai.engine_link import EngineLink
from vconsole.entrypoints.openai.serving_base import OpenAIServing
from vconsole.entrypoints.openai.tracing import RequestTracer, check_endpoint, traces_url
from vconsole.wire.control_client import ControlClient

pytest.importorskip("opentelemetry.sdk.trace", reason="pip install '.[test]' (opentelemetry-sdk)")
pytest.importorskip("opentelemetry.proto", reason="pip install '.[test]' (opentelemetry-proto)")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

pytestmark = pytest.mark.proc

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf, every span kept as a dict."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:          # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                outer.add(req)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req: Any) -> None:
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": {e.name: {a.key: _value(a.value) for a in e.attributes}
                                       for e in s.events},
                            "status": s.status.code, "resource": resource})

    def span(self, request_id: str, timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                hits = [s for s in self.spans
                        if str(s["attrs"].get("gen_ai.request.id", "")).startswith(request_id)]
            if hits:
                assert len(hits) == 1, hits
                return hits[0]
            time.sleep(0.05)
        raise AssertionError(f"no span for {request_id}; got {self.spans}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Server:
    """`build_app` under uvicorn in a thread, tracing to ``endpoint``."""

    def __init__(self, engine: Any, endpoint: str) -> None:
        self.port = free_port()
        serving = OpenAIServing(EngineLink(engine.endpoints["input"], engine.endpoints["output"]),
                                model_name="tiny")
        serving.tracer = RequestTracer(endpoint, schedule_delay_s=0.05)
        self.tracer = serving.tracer
        self.serving = serving
        app = build_app(serving, engine_metrics_url=engine.ready.get("metrics"), version="t")
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    max_retries=0)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server not up"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metric(self, outcome: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        line = f'vconsole:otlp_spans_total{{outcome="{outcome}"}} '
        return next(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(shared_engine: Any, receiver: Receiver) -> Iterator[Server]:
    with Server(shared_engine, receiver.url) as s:
        yield s


def test_a_span_joins_the_callers_trace_with_vllms_attribute_names(server: Server,
                                                                   receiver: Receiver) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    r = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0.5, top_p=0.9, n=2,
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": "trace-me-1",
                       "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    span = receiver.span("trace-me-1")
    assert span["name"] == "llm_request" and span["kind"] == 2           # SPAN_KIND_SERVER
    assert span["trace_id"] == CALLER_TRACE and span["parent"] == CALLER_SPAN
    a = span["attrs"]
    assert r.usage is not None
    assert a["gen_ai.usage.prompt_tokens"] == r.usage.prompt_tokens == len(prompt)
    assert a["gen_ai.usage.completion_tokens"] == r.usage.completion_tokens == 12
    assert a["gen_ai.usage.num_sequences"] == a["gen_ai.request.n"] == 2
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.e2e"] == pytest.approx((span["end"] - span["start"]) / 1e9)
    # the engine's phases of the first sample (its own clock)
    assert 0 <= a["gen_ai.latency.time_in_queue"] < a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] \
        == pytest.approx(a["gen_ai.latency.time_in_model_inference"])
    assert span["resource"]["service.name"] == "vconsole"
    assert span["status"] == 0                                          # unset: fine


DETAILED = ("gen_ai.latency.time_in_scheduler", "gen_ai.latency.time_in_model_forward",
            "gen_ai.latency.time_in_model_execute")


def test_detailed_traces_add_the_requests_share_of_its_steps(shared_engine: Any,
                                                             server: Server,
                                                             receiver: Receiver) -> None:
    """``collect_detailed_traces`` (vLLM's --collect-detailed-traces, a hot key here): the
    span gets the summed schedule, forward and execute time of the steps the request ran in;
    off, it has none of them."""
    control = ControlClient(shared_engine.endpoints["control"], timeout_s=10,
                            key=shared_engine.control_key())
    try:
        on = control.set_config({"collect_detailed_traces": True})
        assert on["ok"]
        server.client.completions.create(model="tiny", prompt=[4] * 40, max_tokens=8,
                                         extra_body={"ignore_eos": True},
                                         extra_headers={"x-request-id": "detailed-1"})
    finally:
        off = control.set_config({"collect_detailed_traces": False})
        assert off["ok"]
        control.close()
    # The config each request ran under, as an event: the version the set bumped to.
    assert off["version"] == on["version"] + 1
    assert receiver.span("detailed-1")["events"]["engine_config"] == {
        "vconsole.config_version": on["version"]}
    a = receiver.span("detailed-1")["attrs"]
    scheduler, forward, execute = (a[k] for k in DETAILED)
    # 8 steps at least (one per token), each timed: the forward is part of the execute phase,
    # and the execute phases the request ran in lie inside its time in the model
    assert scheduler > 0 and 0 < forward <= execute
    assert execute <= a["gen_ai.latency.time_in_model_inference"]
    server.client.completions.create(model="tiny", prompt=[4] * 40, max_tokens=2,
                                     extra_headers={"x-request-id": "detailed-off"})
    assert not set(DETAILED) & set(receiver.span("detailed-off")["attrs"])
    assert receiver.span("detailed-off")["events"]["engine_config"] == {
        "vconsole.config_version": off["version"]}


def test_a_span_counts_from_the_requests_arrival_its_tokenizing_included(
        server: Server, receiver: Receiver) -> None:
    """As vLLM's: the latencies count from the request's arrival, so a slow tokenizer (the
    real one, made to take 0.5 s) is inside the span and its time to first token."""
    tokenizer = server.serving.tokenizer

    class Slow:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return tokenizer(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

    server.serving.tokenizer = Slow()
    try:
        sent = time.time_ns()
        server.client.completions.create(model="tiny", prompt="hello there", max_tokens=2,
                                         extra_headers={"x-request-id": "slow-tokens-1"})
    finally:
        server.serving.tokenizer = tokenizer
    span = receiver.span("slow-tokens-1")
    assert sent <= span["start"] < sent + 400_000_000        # before the 0.5 s of tokenizing
    assert span["attrs"]["gen_ai.latency.time_to_first_token"] >= 0.5


def test_without_a_traceparent_a_span_starts_its_own_trace(server: Server,
                                                           receiver: Receiver) -> None:
    server.client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=2,
                                     extra_headers={"x-request-id": "own-trace-1"})
    span = receiver.span("own-trace-1")
    assert span["parent"] == "" and span["trace_id"] not in ("", CALLER_TRACE)


def test_a_streamed_chat_has_its_span_with_the_prefix_cache_hit_as_an_event(
        server: Server, receiver: Receiver) -> None:
    messages = [{"role": "user", "content": "the same long prompt, twice over " * 4}]
    for rid in ("stream-1", "stream-2"):       # the second finds the first's blocks cached
        chunks = list(server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, stream=True,  # type: ignore[arg-type]
            extra_headers={"x-request-id": rid}))
        assert chunks
    span = receiver.span("stream-2")
    assert span["attrs"]["gen_ai.usage.completion_tokens"] >= 1
    assert "gen_ai.latency.time_to_first_token" in span["attrs"]
    assert span["events"]["prefix_cache_hit"]["gen_ai.usage.cached_tokens"] > 0
    assert server.metric("exported") >= 3 and server.metric("failed") == 0


def test_a_dead_collector_costs_a_counter_not_a_request(shared_engine: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"              # nothing listens there
    with Server(shared_engine, dead) as s:
        for i in range(5):
            r = s.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                                            extra_headers={"x-request-id": f"dead-{i}"})
            assert r.choices[0].finish_reason in ("length", "stop")
        deadline = time.monotonic() + 60
        while s.metric("failed") < 5:
            assert time.monotonic() < deadline, "the failed exports were never counted"
            time.sleep(0.2)
        assert s.metric("exported") == 0 and s.metric("ended") == 5


def test_the_endpoint_is_an_http_url_and_gets_otlps_traces_path() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    assert check_endpoint("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    for bad in ("collector:4318", "grpc://c:4317", "http://"):
        with pytest.raises(ValueError, match="http\\(s\\) URL"):
            traces_url(bad)


def test_serve_refuses_an_endpoint_that_is_not_a_url_before_starting_an_engine() -> None:
    done = subprocess.run([sys.executable, "-m", "vconsole", "serve", "--port",
                           str(free_port()), "--otlp-traces-endpoint", "collector:4318"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--otlp-traces-endpoint wants an http(s) URL" in done.stderr
    assert "engine" not in done.stderr.lower().replace("--otlp-traces-endpoint", "")
