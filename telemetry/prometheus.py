"""Prometheus export: ``/metrics`` built from the telemetry the publisher last sent.

Why from the stream and not from the engine: a scrape must never disagree with what the console
and `vconsole top` show. `TelemetryCollector.collect` reads `TelemetryPublisher.last_bodies` (the
last payload sent on each topic, one consistent copy per scrape) and turns it into metric
families; the engine's busy loop is never asked for anything, so a scrape costs it nothing.

Names and types are vLLM's where the meaning is the same (`vllm/v1/metrics/loggers.py`), with
its labels ``model_name`` and ``engine`` (our ``dp_rank``); what vLLM lacks is ``vconsole:*``.
Counters are cumulative since the engine process started (prometheus_client exposes them with a
``_total`` suffix); a restarted engine starts them over, which Prometheus's ``rate()`` handles.
Histograms are the cumulative bucket counts the stream carries (``latency`` topic's
``overall.histograms``, ``step`` topic's ``iteration_tokens``), with vLLM's bucket bounds.

Invariant: every figure of a scrape is a field of the last message of its topic, unchanged, so
on an idle engine (whose messages repeat) a scrape equals the stream. A topic not heard yet
contributes no samples.

`MetricsServer` serves one collector over HTTP (prometheus_client's WSGI server, in its own
registry: no process-global state). Where it may bind is `vconsole.engine.proc.bind_policy`'s
call (loopback unless ``--allow-remote-metrics``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vconsole.telemetry.alerts import CRITICAL, RULES, WARNING

LABELS = ("model_name", "engine")
ALERT_LEVEL_VALUES = {WARNING: 1.0, CRITICAL: 2.0}   # anything else (ok): 0

# latency series (`vconsole.engine.latency`) -> vLLM histogram name, help
LATENCY_HISTOGRAMS = {
    "ttft_s": ("vllm:time_to_first_token_seconds",
               "Histogram of time to first token in seconds."),
    "itl_s": ("vllm:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds."),
    "e2e_s": ("vllm:e2e_request_latency_seconds",
              "Histogram of e2e request latency in seconds."),
    "queue_s": ("vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request."),
    "prefill_s": ("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request."),
    "decode_s": ("vllm:request_decode_time_seconds",
                 "Histogram of time spent in DECODE phase for request."),
    "inference_s": ("vllm:request_inference_time_seconds",
                    "Histogram of time spent in RUNNING phase for request."),
}
PHASES = ("schedule", "execute", "update")
KV_BLOCK_STATES = {"free": "num_free", "used": "num_used", "cached": "num_cached",
                   "shared": "num_shared"}


class BodySource(Protocol):
    def last_bodies(self) -> dict[str, dict[str, Any]]: ...


def histogram_buckets(h: dict[str, Any]) -> list[tuple[str, float]]:
    """A wire histogram (``bounds``, cumulative ``counts``, the last bound +Inf) as
    prometheus_client's ``(le, cumulative count)`` pairs, ending with ``+Inf`` = ``count``."""
    pairs = [(floatToGoString(b), c) for b, c in zip(h["bounds"], h["counts"], strict=True)]
    if not pairs or pairs[-1][0] != "+Inf":
        pairs.append(("+Inf", h["count"]))
    return pairs


class TelemetryCollector(Collector):
    """A prometheus_client collector over ``source.last_bodies()`` (a `TelemetryPublisher`);
    see the module docstring. ``model_name`` and ``engine`` are every sample's labels."""

    def __init__(self, source: BodySource, *, model_name: str, engine: int | str = 0) -> None:
        self._source = source
        self._labels = [str(model_name), str(engine)]

    def collect(self) -> Iterator[Metric]:
        bodies = self._source.last_bodies()
        for topic, families in (("sched", self._sched), ("kv", self._kv),
                                ("step", self._step), ("latency", self._latency),
                                ("health", self._health), ("config", self._config)):
            body = bodies.get(topic)
            if body is not None:
                yield from families(body)

    # --- one method per topic ---------------------------------------------------------------

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self._labels, float(value))
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self._labels, float(value))
        return c

    def _histogram(self, name: str, doc: str, h: dict[str, Any]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=LABELS)
        fam.add_metric(self._labels, histogram_buckets(h), h["sum"])
        return fam

    def _per(self, kind: type[Metric], name: str, doc: str, label: str,
             values: Iterable[tuple[str, float]]) -> Metric:
        fam = kind(name, doc, labels=[*LABELS, label])
        for key, value in values:
            fam.add_metric([*self._labels, key], float(value))
        return fam

    def _sched(self, b: dict[str, Any]) -> Iterator[Metric]:
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", b["num_running"])
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", b["num_waiting"])
        yield self._gauge("vconsole:num_requests_preempted",
                          "Of the waiting requests, those preempted and waiting to resume.",
                          b["num_preempted"])
        yield self._counter("vllm:num_preemptions",
                            "Cumulative number of preemption from the engine.",
                            b["num_preemptions_total"])
        if "num_prompt_tokens_total" in b:      # added within schema version 1
            yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                b["num_prompt_tokens_total"])
        if "num_generation_tokens_total" in b:
            yield self._counter("vllm:generation_tokens",
                                "Number of generation tokens processed.",
                                b["num_generation_tokens_total"])

    def _kv(self, b: dict[str, Any]) -> Iterator[Metric]:
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", b["usage"])
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            b["prefix_queries"])
        yield self._counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            b["prefix_hits"])
        yield self._gauge("vconsole:kv_block_usage_perc",
                          "KV blocks referenced by a request / all blocks (1 = 100 percent).",
                          b["usage"])
        yield self._gauge("vconsole:kv_token_usage_perc",
                          "Tokens stored / token slots in the KV pool (1 = 100 percent).",
                          b["token_usage"])
        yield self._gauge("vconsole:kv_fragmentation",
                          "1 - tokens stored / slots of allocated KV blocks (0 when none).",
                          b["fragmentation"])
        yield self._per(GaugeMetricFamily, "vconsole:kv_blocks",
                        "KV blocks by state (shared blocks are also counted as used).", "state",
                        ((state, b[field]) for state, field in KV_BLOCK_STATES.items()))

    def _step(self, b: dict[str, Any]) -> Iterator[Metric]:
        h = b.get("iteration_tokens")
        if h is not None:
            yield self._histogram("vllm:iteration_tokens_total",
                                  "Histogram of number of tokens per engine_step.", h)
        phases = b.get("phase_s_total")
        if phases is not None:
            yield self._per(CounterMetricFamily, "vconsole:step_phase_seconds",
                            "Engine step time by phase (schedule, execute, update), seconds.",
                            "phase", ((p, phases[p]) for p in PHASES if p in phases))
        yield self._gauge("vconsole:scheduler_share",
                          "Schedule time / step time over the last telemetry window (0 when "
                          "idle).", b["sched_share"])

    def _latency(self, b: dict[str, Any]) -> Iterator[Metric]:
        hists = b["overall"]["histograms"]
        for series, (name, doc) in LATENCY_HISTOGRAMS.items():
            if series in hists:
                yield self._histogram(name, doc, hists[series])
        yield self._per(CounterMetricFamily, "vllm:request_success",
                        "Count of processed requests by finish reason.", "finished_reason",
                        sorted(b.get("finished", {}).items()))

    def _health(self, b: dict[str, Any]) -> Iterator[Metric]:
        active = b.get("alerts_active") or {}
        names = [*RULES, *sorted(n for n in active if n not in RULES)]
        yield self._per(GaugeMetricFamily, "vconsole:alert_level",
                        "Alert level per alert: 0 ok, 1 warning, 2 critical.", "alert",
                        ((n, ALERT_LEVEL_VALUES.get(active.get(n, ""), 0.0)) for n in names))
        if "restart_count" in b:
            yield self._counter("vconsole:engine_restarts",
                                "How often the supervisor restarted this engine.",
                                b["restart_count"])

    def _config(self, b: dict[str, Any]) -> Iterator[Metric]:
        yield self._gauge("vconsole:config_version",
                          "Version of the config in force (increases with every change).",
                          b["version"])


class MetricsServer:
    """``/metrics`` over HTTP for one collector, on ``host:port`` (port 0: a free one, read
    back from `port` / `url` after `start`). Its request threads only read the collector."""

    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._registry = CollectorRegistry()
        self._registry.register(collector)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        """Bind and serve; raises OSError here (e.g. the port is in use)."""
        self._server, self._thread = start_http_server(self.port, addr=self.host,
                                                       registry=self._registry)
        self.port = int(self._server.server_address[1])
        return self

    def close(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = None
