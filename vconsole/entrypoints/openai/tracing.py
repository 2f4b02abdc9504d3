"""OpenTelemetry request traces (`vconsole serve --otlp-traces-endpoint URL`), as vLLM's.

One span per prompt a generation request sends to the engine (``llm_request``, kind SERVER), its
``n`` samples together, with vLLM's attribute names (``vllm/tracing``'s ``SpanAttributes``): the
request's id, model and sampling parameters, its token usage, its time to first token and
end-to-end latency on the server's clock (as vLLM's front end measures them), and the engine's
phases of its first sample (``gen_ai.latency.time_in_queue``, ``time_in_model_prefill``,
``time_in_model_decode``, ``time_in_model_inference``; `RequestOutput.timings`). What our engine knows beyond vLLM rides along as span events: ``preempted``
(how often its KV blocks were taken back), ``prefix_cache_hit`` (prompt tokens served from the
prefix cache), ``engine_config`` (the engine's config version in force when it finished: which
`vconsole set` served it). The W3C ``traceparent`` / ``tracestate`` headers of the HTTP request (`incoming`,
set by the route) make the span a child of the caller's: it joins the caller's trace.

Export never slows a request: spans are handed to the SDK's `BatchSpanProcessor` (a bounded
queue, exported by its own thread in batches, OTLP over HTTP/protobuf); a collector that is down
or slow costs that thread a timeout and the spans a ``failed`` count
(``vconsole:otlp_spans_total{outcome="failed"}`` on the server's /metrics), never the request.
The SDK is optional (``pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http``);
`RequestTracer` says so when it is missing.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

INSTALL = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")
OTLP_TRACES_PATH = "/v1/traces"
EXPORT_TIMEOUT_S = 2.0      # one export's budget: a dead collector costs the export thread this
MAX_QUEUE = 2048            # spans waiting for export; beyond, the SDK drops them

# vLLM's SpanAttributes (vllm/tracing): the names a trace backend already knows.
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
# the engine's phases (RequestOutput.timings) -> vLLM's attribute
PHASE_ATTRIBUTES = {"queue_s": LATENCY_TIME_IN_QUEUE,
                    "prefill_s": "gen_ai.latency.time_in_model_prefill",
                    "decode_s": "gen_ai.latency.time_in_model_decode",
                    "inference_s": "gen_ai.latency.time_in_model_inference",
                    # with collect_detailed_traces: the sums over the steps it ran in
                    "scheduler_s": "gen_ai.latency.time_in_scheduler",
                    "forward_s": "gen_ai.latency.time_in_model_forward",
                    "execute_s": "gen_ai.latency.time_in_model_execute"}

# The HTTP request's headers, set by the generation route for the spans its prompts start.
incoming: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "vconsole_trace_headers", default=None)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given when it names a path, else with
    ``/v1/traces`` added (as OTEL_EXPORTER_OTLP_ENDPOINT is read). A clear ValueError for
    anything but an http(s) URL."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint wants an http(s) URL such as "
                         f"http://127.0.0.1:4318/v1/traces, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def check_endpoint(endpoint: str) -> str:
    """`traces_url`, once the SDK and the exporter are known to import: what `vconsole serve`
    checks before it starts an engine. ValueError / RuntimeError say what is wrong."""
    import importlib.util

    url = traces_url(endpoint)
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP "
                               f"exporter ({module} is missing): {INSTALL}")
    return url


class ExportCounts:
    """Spans by outcome: ``ended`` (handed to the export queue), ``exported``, ``failed`` (the
    collector refused or never answered). ended - exported - failed: queued, or dropped by a
    full queue. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"ended": 0, "exported": 0, "failed": 0}

    def add(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.counts[outcome] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _CountsCollector(Collector):
    def __init__(self, counts: ExportCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("vconsole:otlp_spans", "Request spans by outcome: ended "
                                  "(queued for export), exported, failed (the collector was "
                                  "down or refused them).", labels=["outcome"])
        for outcome, n in self._counts.snapshot().items():
            fam.add_metric([outcome], n)
        yield fam


class RequestTracer:
    """The server's tracer: its own TracerProvider (no process-global state), a batch
    processor exporting to ``endpoint``. ``exporter``: another SpanExporter (tests)."""

    def __init__(self, endpoint: str, *, service_name: str = "vconsole",
                 exporter: Any = None, schedule_delay_s: float = 0.5) -> None:
        url = traces_url(endpoint)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
                exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        except ImportError as e:
            raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP "
                               f"exporter ({e.name} is missing): {INSTALL}") from e
        self.url = url
        self.counts = ExportCounts()
        self._provider = TracerProvider(resource=Resource.create({"service.name":
                                                                  service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(
            _counting(exporter, self.counts), max_queue_size=MAX_QUEUE,
            schedule_delay_millis=int(schedule_delay_s * 1000),
            export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000)))
        self._tracer = self._provider.get_tracer("vconsole.entrypoints.openai")
        self._propagator = TraceContextTextMapPropagator()

    def collector(self) -> Collector:
        """``vconsole:otlp_spans_total{outcome}`` for the server's /metrics."""
        return _CountsCollector(self.counts)

    def start(self, request_id: str, model: str, sampling: Mapping[str, Any],
              num_prompt_tokens: int, arrival_ns: int | None = None) -> RequestSpan:
        """A request's span, started at ``arrival_ns`` (default now), the child of the caller's
        span when `incoming` headers carry a ``traceparent``."""
        from opentelemetry.trace import SpanKind

        headers = incoming.get()
        ctx = None
        if headers is not None and any(h in headers for h in TRACE_HEADERS):
            ctx = self._propagator.extract(carrier={h: headers[h] for h in TRACE_HEADERS
                                                    if h in headers})
        start_ns = arrival_ns or time.time_ns()
        span = self._tracer.start_span(SPAN_NAME, context=ctx, kind=SpanKind.SERVER,
                                       start_time=start_ns)
        attrs = {REQUEST_ID: request_id, RESPONSE_MODEL: model,
                 USAGE_PROMPT_TOKENS: num_prompt_tokens,
                 REQUEST_MAX_TOKENS: sampling.get("max_tokens"),
                 REQUEST_TEMPERATURE: sampling.get("temperature"),
                 REQUEST_TOP_P: sampling.get("top_p"), REQUEST_N: sampling.get("n")}
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})
        return RequestSpan(span, self.counts, start_ns)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout), then stop."""
        self._provider.shutdown()


class RequestSpan:
    """One prompt's span while its samples run: `first_token` once, then `end`."""

    def __init__(self, span: Any, counts: ExportCounts, start_ns: int) -> None:
        self._span = span
        self._counts = counts
        self._start_ns = start_ns
        self._first_ns: int | None = None

    def first_token(self) -> None:
        if self._first_ns is None:
            self._first_ns = time.time_ns()

    def end(self, completion_tokens: int, finish_reasons: Sequence[str | None], *,
            num_cached_tokens: int = 0, num_preemptions: int = 0,
            timings: Mapping[str, float] | None = None,
            config_version: int | None = None,
            error: BaseException | None = None) -> None:
        """Its usage and latencies; ``timings``: the engine's phases of its first sample."""
        from opentelemetry.trace import Status, StatusCode

        now = time.time_ns()
        span = self._span
        span.set_attribute(USAGE_COMPLETION_TOKENS, completion_tokens)
        span.set_attribute(USAGE_NUM_SEQUENCES, len(finish_reasons))
        span.set_attribute(RESPONSE_FINISH_REASONS, [r or "" for r in finish_reasons])
        if self._first_ns is not None:
            span.set_attribute(LATENCY_TIME_TO_FIRST_TOKEN, (self._first_ns - self._start_ns) / 1e9)
        span.set_attribute(LATENCY_E2E, (now - self._start_ns) / 1e9)
        for phase, seconds in (timings or {}).items():
            if phase in PHASE_ATTRIBUTES:
                span.set_attribute(PHASE_ATTRIBUTES[phase], seconds)
        if num_cached_tokens:
            span.add_event("prefix_cache_hit", {"gen_ai.usage.cached_tokens": num_cached_tokens})
        if num_preemptions:
            span.add_event("preempted", {"vconsole.num_preemptions": num_preemptions})
        if config_version is not None:
            span.add_event("engine_config", {"vconsole.config_version": config_version})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(end_time=now)
        self._counts.add("ended")


def _counting(exporter: Any, counts: ExportCounts) -> Any:
    """``exporter`` wrapped so each batch's spans count as exported or failed (an exception
    from it counts as failed: the export thread carries on)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Counting(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            try:
                result = exporter.export(spans)
            except Exception:
                result = SpanExportResult.FAILURE
            counts.add("exported" if result == SpanExportResult.SUCCESS else "failed",
                       len(spans))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    return Counting()
