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

Data parallel (`vconsole engine --data-parallel-size N`): `RanksCollector` takes the last
bodies of every rank (the front end's proxy keeps them) and exposes each rank's series with
``engine="<rank>"``, plus ``vconsole:dp_*`` from the ``dp`` topic; each family is exposed once
with every rank's samples. `TelemetryCollector` (one engine, one publisher) is its one-rank case,
so both go through the same code.

Invariant: every figure of a scrape is a field of the last message of its topic, unchanged, so
on an idle engine (whose messages repeat) a scrape equals the stream. A topic not heard yet
contributes no samples.

`MetricsServer` serves one collector over HTTP (prometheus_client's WSGI server, in its own
registry: no process-global state). Where it may bind is `vconsole.security.bind_policy`'s
call (loopback unless ``--allow-remote-metrics``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
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

from vconsole.engine.request import FinishReason
from vconsole.shared.config import canonical_kv_cache_dtype
from vconsole.telemetry.alerts import CRITICAL, RULES, WARNING
from vconsole.telemetry.vllm_names import LATENCY_HISTOGRAMS

LABELS = ("model_name", "engine")
ALERT_LEVEL_VALUES = {WARNING: 1.0, CRITICAL: 2.0}   # anything else (ok): 0

PHASES = ("schedule", "execute", "update", "structured")
KV_BLOCK_STATES = {"free": "num_free", "used": "num_used", "cached": "num_cached",
                   "shared": "num_shared"}
# --kv-cache-metrics: the ``step`` topic's ``kv_residency`` histograms, by vLLM's names and help.
_SAMPLED = " Sampled metrics (controlled by --kv-cache-metrics-sample)."
KV_RESIDENCY_HISTOGRAMS = {
    "lifetime_s": ("vllm:kv_block_lifetime_seconds",
                   "Histogram of KV cache block lifetime from allocation to eviction." + _SAMPLED),
    "idle_before_evict_s": ("vllm:kv_block_idle_before_evict_seconds",
                            "Histogram of idle time before KV cache block eviction." + _SAMPLED),
    "reuse_gap_s": ("vllm:kv_block_reuse_gap_seconds",
                    "Histogram of time gaps between consecutive KV cache block accesses. Only "
                    "the most recent accesses are recorded (ring buffer)." + _SAMPLED),
}
# --enable-mfu-metrics: the ``step`` topic's ``perf`` counters (prometheus_client adds _total).
PERF_COUNTERS = {
    "flops_total": ("vllm:estimated_flops_per_gpu", "Estimated number of floating point "
                    "operations per GPU (for Model Flops Utilization calculations)."),
    "read_bytes_total": ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read "
                         "from memory per GPU (for Model Flops Utilization calculations)."),
    "write_bytes_total": ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes "
                          "written to memory per GPU (for Model Flops Utilization "
                          "calculations)."),
}


class BodySource(Protocol):
    def last_bodies(self) -> dict[str, dict[str, Any]]: ...


# The last payload per topic of each rank: {rank: {topic: body}}.
BodiesByRank = Mapping[Any, Mapping[str, dict[str, Any]]]   # rank (int, or str off the wire)
DP_GROUP_STATES = ("none", "forming", "ok", "broken")


def metrics_url(host: str, port: int) -> str:
    """The scrape URL of a ``/metrics`` served on ``host:port`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def histogram_buckets(h: dict[str, Any]) -> list[tuple[str, float]]:
    """A wire histogram (``bounds``, cumulative ``counts``, the last bound +Inf) as
    prometheus_client's ``(le, cumulative count)`` pairs, ending with ``+Inf`` = ``count``."""
    pairs = [(floatToGoString(b), c) for b, c in zip(h["bounds"], h["counts"], strict=True)]
    if not pairs or pairs[-1][0] != "+Inf":
        pairs.append(("+Inf", h["count"]))
    return pairs


class _Families:
    """Metric families of one scrape, by name in first-seen order: every rank adds its samples
    to the same family, so each name is exposed once (HELP, TYPE, then all ranks)."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def _family(self, kind: Callable[..., Metric], name: str, doc: str, labels: list[str]) -> Any:
        fam = self.by_name.get(name)
        if fam is None:
            fam = self.by_name[name] = kind(name, doc, labels=labels)
        return fam


class _Rank:
    """The samples of one rank: ``labels`` (model name, engine rank) on every one."""

    def __init__(self, out: _Families, labels: list[str]) -> None:
        self.out = out
        self.labels = labels

    def gauge(self, name: str, doc: str, value: float) -> None:
        self.out._family(GaugeMetricFamily, name, doc, list(LABELS)).add_metric(
            self.labels, float(value))

    def counter(self, name: str, doc: str, value: float) -> None:
        self.out._family(CounterMetricFamily, name, doc, list(LABELS)).add_metric(
            self.labels, float(value))

    def histogram(self, name: str, doc: str, h: dict[str, Any]) -> None:
        self.out._family(HistogramMetricFamily, name, doc, list(LABELS)).add_metric(
            self.labels, histogram_buckets(h), h["sum"])

    def per(self, kind: type[Metric], name: str, doc: str, label: str,
            values: Iterable[tuple[str, float]]) -> None:
        fam = self.out._family(kind, name, doc, [*LABELS, label])
        for key, value in values:
            fam.add_metric([*self.labels, key], float(value))


class RanksCollector(Collector):
    """A prometheus_client collector over ``bodies_by_rank()`` — ``{rank: {topic: last
    payload}}``, one entry per engine rank (a data-parallel front end passes the last bodies it
    proxied from each rank; a lone engine is the one-rank case, `TelemetryCollector`). Every
    rank's series carry ``engine="<rank>"`` (vLLM's data-parallel label) and ``model_name``;
    ranks are exposed in ascending order. The ``dp`` topic adds the ``vconsole:dp_*`` series.
    ``bodies_by_rank`` is called once per scrape and must return a consistent copy."""

    def __init__(self, bodies_by_rank: Callable[[], BodiesByRank], *, model_name: str) -> None:
        self._bodies_by_rank = bodies_by_rank
        self._model_name = str(model_name)

    def collect(self) -> Iterator[Metric]:
        out = _Families()
        ranks = self._bodies_by_rank()
        for rank in sorted(ranks, key=_rank_order):
            bodies = ranks[rank]
            r = _Rank(out, [self._model_name, str(rank)])
            for topic, families in (("sched", _sched), ("kv", _kv), ("step", _step),
                                    ("latency", _latency), ("health", _health),
                                    ("config", _config), ("dp", _dp), ("gpu", _gpu)):
                body = bodies.get(topic)
                if body is not None:
                    families(r, body)
            _cache_config_info(out, str(rank), bodies)
        yield from out.by_name.values()


def _rank_order(rank: int | str) -> tuple[int, str]:
    try:
        return int(rank), ""
    except (TypeError, ValueError):
        return 1 << 30, str(rank)


class TelemetryCollector(RanksCollector):
    """The one-rank case: a collector over ``source.last_bodies()`` (a `TelemetryPublisher`);
    see the module docstring. ``model_name`` and ``engine`` are every sample's labels."""

    def __init__(self, source: BodySource, *, model_name: str, engine: int | str = 0) -> None:
        super().__init__(lambda: {engine: source.last_bodies()}, model_name=model_name)


# --- one function per topic ------------------------------------------------------------------

def _sched(r: _Rank, b: dict[str, Any]) -> None:
    r.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
            b["num_running"])
    r.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            b["num_waiting"])
    # vLLM's split of the waiting requests: ``capacity`` (queued for a seat, blocks or tokens:
    # all of ours), ``deferred`` (held by a transient constraint: a structured-output grammar
    # compiling, which our scheduler keeps beside the queue, not in vllm:num_requests_waiting).
    r.per(GaugeMetricFamily, "vllm:num_requests_waiting_by_reason",
          "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
          "scheduling capacity; 'deferred' = deferred by transient constraints (a grammar "
          "compiling).", "reason",
          (("capacity", b["num_waiting"]), ("deferred", b.get("num_compiling", 0))))
    r.gauge("vconsole:num_requests_preempted",
            "Of the waiting requests, those preempted and waiting to resume.", b["num_preempted"])
    r.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
              b["num_preemptions_total"])
    if "num_prompt_tokens_total" in b:      # added within schema version 1
        r.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                  b["num_prompt_tokens_total"])
    if "num_generation_tokens_total" in b:
        r.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                  b["num_generation_tokens_total"])
    if "structured_compiles_total" in b:     # structured outputs (the engine's compile threads)
        r.gauge("vconsole:structured_output_requests_compiling",
                "Requests waiting for their structured-output grammar to compile.",
                b["num_compiling"])
        r.counter("vconsole:structured_output_compiles",
                  "Structured-output grammars compiled (cache misses).",
                  b["structured_compiles_total"])
        r.counter("vconsole:structured_output_compile_cache_hits",
                  "Structured-output requests served a grammar from the compile cache.",
                  b["structured_compile_cache_hits_total"])
        r.counter("vconsole:structured_output_compile_errors",
                  "Structured-output grammars that failed to compile (their requests failed).",
                  b["structured_compile_errors_total"])
        r.counter("vconsole:structured_output_compile_seconds",
                  "Seconds spent compiling structured-output grammars, off the busy loop.",
                  b["structured_compile_seconds_total"])


    spec = b.get("spec_decode")
    if spec:                                 # only where speculation is configured, as vLLM
        r.counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                  spec["num_drafts"])
        r.counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                  spec["num_draft_tokens"])
        r.counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                  spec["num_accepted_tokens"])
        r.per(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_per_pos",
              "Accepted tokens per draft position.", "position",
              ((str(i), v) for i, v in enumerate(spec["accepted_per_pos"])))


def _kv(r: _Rank, b: dict[str, Any]) -> None:
    r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", b["usage"])
    r.counter("vllm:prefix_cache_queries",
              "Prefix cache queries, in terms of number of queried tokens.", b["prefix_queries"])
    r.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              b["prefix_hits"])
    r.gauge("vconsole:kv_block_usage_perc",
            "KV blocks referenced by a request / all blocks (1 = 100 percent).", b["usage"])
    r.gauge("vconsole:kv_token_usage_perc",
            "Tokens stored / token slots in the KV pool (1 = 100 percent).", b["token_usage"])
    r.gauge("vconsole:kv_fragmentation",
            "1 - tokens stored / slots of allocated KV blocks (0 when none).", b["fragmentation"])
    r.per(GaugeMetricFamily, "vconsole:kv_blocks",
          "KV blocks by state (shared blocks are also counted as used).", "state",
          ((state, b[field]) for state, field in KV_BLOCK_STATES.items()))
    if b.get("bytes_per_token") is not None:     # an engine from before the KV dtypes: none
        r.gauge("vconsole:kv_cache_bytes_per_token",
                "Bytes one token takes in the KV pool (K and V, every layer, scales included).",
                b["bytes_per_token"])
    if b.get("capacity_tokens") is not None:
        r.gauge("vconsole:kv_cache_capacity_tokens",
                "Token slots in the KV pool (blocks x block size).", b["capacity_tokens"])


def _step(r: _Rank, b: dict[str, Any]) -> None:
    h = b.get("iteration_tokens")
    if h is not None:
        r.histogram("vllm:iteration_tokens_total",
                    "Histogram of number of tokens per engine_step.", h)
    phases = b.get("phase_s_total")
    if phases is not None:
        r.per(CounterMetricFamily, "vconsole:step_phase_seconds",
              "Engine step time by phase (schedule, execute, update, structured), seconds.",
              "phase",
              ((p, phases[p]) for p in PHASES if p in phases))
    r.gauge("vconsole:scheduler_share",
            "Schedule time / step time over the last telemetry window (0 when idle).",
            b["sched_share"])
    if "step_time_p50_s" in b:
        r.gauge("vconsole:step_time_p50_seconds",
                "Median step time over the last telemetry window (0 when no step ran).",
                b["step_time_p50_s"])
    residency = b.get("kv_residency")
    if residency is not None:
        for key, (name, doc) in KV_RESIDENCY_HISTOGRAMS.items():
            r.histogram(name, doc, residency[key])
    perf = b.get("perf")
    if perf is not None:
        for key, (name, doc) in PERF_COUNTERS.items():
            r.counter(name, doc, perf[key])


def _latency(r: _Rank, b: dict[str, Any]) -> None:
    hists = b["overall"]["histograms"]
    for series, (name, doc) in LATENCY_HISTOGRAMS.items():
        if series in hists:
            r.histogram(name, doc, hists[series])
    # Every finish reason from the first scrape on, at 0 until one happens (as vLLM creates its
    # label sets up front): a series born at 24 would hide its first 24 from rate().
    finished = {**dict.fromkeys(map(str, FinishReason), 0), **(b.get("finished") or {})}
    r.per(CounterMetricFamily, "vllm:request_success",
          "Count of processed requests by finish reason.", "finished_reason",
          sorted(finished.items()))


def _health(r: _Rank, b: dict[str, Any]) -> None:
    active = b.get("alerts_active") or {}
    names = [*RULES, *sorted(n for n in active if n not in RULES)]
    r.per(GaugeMetricFamily, "vconsole:alert_level",
          "Alert level per alert: 0 ok, 1 warning, 2 critical.", "alert",
          ((n, ALERT_LEVEL_VALUES.get(active.get(n, ""), 0.0)) for n in names))
    if "restart_count" in b:
        r.counter("vconsole:engine_restarts", "How often the supervisor restarted this engine.",
                  b["restart_count"])
    if "telemetry_errors" in b:
        r.counter("vconsole:telemetry_errors",
                  "Telemetry failures the engine survived (the cache rebuilt, serving on).",
                  b["telemetry_errors"])
    r.gauge("vconsole:engine_up", "1 while an engine process serves, 0 while it restarts.",
            0.0 if b.get("state") == "restarting" else 1.0)


def _config(r: _Rank, b: dict[str, Any]) -> None:
    r.gauge("vconsole:config_version",
            "Version of the config in force (increases with every change).", b["version"])


def _cache_config_info(out: _Families, engine: str, bodies: Mapping[str, dict[str, Any]]
                       ) -> None:
    """vLLM's ``vllm:cache_config_info``: value 1, the cache config as labels (``engine``, no
    ``model_name``, as vLLM), so a scraper that reads vLLM (`vconsole attach --vllm`) finds the
    pool's size and block size here too."""
    kv, cfg = bodies.get("kv"), bodies.get("config")
    if kv is None or cfg is None:
        return
    values = cfg.get("values") or {}
    labels = {"block_size": kv.get("block_size"), "num_gpu_blocks": kv.get("num_blocks"),
              "enable_prefix_caching": values.get("enable_prefix_caching"),
              "gpu_memory_utilization": values.get("gpu_memory_utilization"),
              "cache_dtype": _cache_dtype(values, kv)}
    fam = out._family(GaugeMetricFamily, "vllm:cache_config_info",
                      "Information of the LLMEngine CacheConfig", ["engine", *labels])
    fam.add_metric([engine, *(str(v) for v in labels.values())], 1.0)


def _cache_dtype(values: Mapping[str, Any], kv: Mapping[str, Any]) -> str:
    """vLLM's ``cache_dtype`` label: the configured KV cache dtype (``auto``: the model's
    dtype; ``int8`` is spelled ``int8_per_token_head``), as vLLM's ``CacheConfig`` says it; an
    engine whose config does not name one says what its pool stores, else ``auto``."""
    name = values.get("kv_cache_dtype")
    if isinstance(name, str):
        try:
            return canonical_kv_cache_dtype(name)
        except ValueError:
            return name
    stored = kv.get("cache_dtype")
    return stored if isinstance(stored, str) else "auto"


def _dp(r: _Rank, b: dict[str, Any]) -> None:
    """The ``dp`` topic (data-parallel ranks only): waves, dummy steps, the busy all-reduce."""
    r.gauge("vconsole:dp_world_size", "Ranks in the data-parallel group.", b["world_size"])
    r.gauge("vconsole:dp_wave", "The wave this rank is in (or will start next).", b["wave"])
    r.gauge("vconsole:dp_wave_running", "1 while this rank is in a wave, else 0.",
            1.0 if b["wave_running"] else 0.0)
    r.gauge("vconsole:dp_group_generation", "Generation of the process group (+1 per regroup).",
            b["group_generation"])
    r.per(GaugeMetricFamily, "vconsole:dp_group_state",
          "1 for the process group's current state (none, forming, ok, broken), else 0.",
          "state", ((s, 1.0 if b["group_state"] == s else 0.0) for s in DP_GROUP_STATES))
    r.counter("vconsole:dp_steps", "Steps run by this rank, dummy ones included.",
              b["steps_total"])
    r.counter("vconsole:dp_dummy_steps",
              "Dummy steps run while idle to keep the group's collective steps in lockstep.",
              b["dummy_steps_total"])
    r.gauge("vconsole:dp_dummy_share", "Dummy steps / steps (as the rank reports it).",
            b["dummy_share"])
    r.counter("vconsole:dp_syncs", "All-reduces deciding whether any rank is busy.",
              b["sync_count_total"])
    r.counter("vconsole:dp_sync_seconds", "Seconds spent in those all-reduces.",
              b["sync_s_total"])
    r.gauge("vconsole:dp_sync_seconds_per_step", "All-reduce seconds per step.",
            b["sync_s_per_step"])


def _gpu(r: _Rank, b: dict[str, Any]) -> None:
    """The ``gpu`` topic (NVML): memory and utilisation per device, labelled ``device``
    (its index); none without NVML or a GPU (the topic then names the reason)."""
    devices = [d for d in b.get("devices") or () if isinstance(d, dict)]
    for name, field, doc in (
            ("vconsole:gpu_memory_used_bytes", "mem_used", "GPU memory in use, bytes (NVML)."),
            ("vconsole:gpu_memory_total_bytes", "mem_total", "GPU memory, bytes (NVML)."),
            ("vconsole:gpu_utilization_perc", "util",
             "GPU utilisation, 0 to 1 (NVML's percent / 100).")):
        scale = 0.01 if field == "util" else 1.0
        values = [(str(d.get("index", i)), d[field] * scale)
                  for i, d in enumerate(devices) if d.get(field) is not None]
        if values:
            r.per(GaugeMetricFamily, name, doc, "device", values)


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
        return metrics_url(self.host, self.port)

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
