"""A vLLM server's Prometheus ``/metrics`` as the console's telemetry messages.

`VllmTranslator.translate` takes the text of one scrape and returns, per ``engine`` label value
(vLLM's data-parallel rank; one rank when there is no such label), the ``health``, ``step``,
``sched``, ``kv``, ``latency`` and ``config`` messages of `vconsole.telemetry.schema`, encoded
exactly as our own engine's publisher sends them. Everything downstream — `ConsoleState`, the
screens, `vconsole top --json`, recordings — then works unchanged; a message carries
``"source": "vllm"`` and ``not_exposed`` (the fields vLLM has no metric for: per-request rows,
the physical block map, step phases), so the screens say so instead of drawing zeros.

What comes from where (names as `vllm/v1/metrics/loggers.py` defines them, and the older names
a scraper still meets — see `ALIASES`):

- ``sched``: ``vllm:num_requests_running`` / ``_waiting`` (gauges), ``vllm:num_preemptions``,
  ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success`` (counters).
- ``kv``: ``vllm:kv_cache_usage_perc`` (older ``vllm:gpu_cache_usage_perc``), prefix-cache
  queries and hits, the pool's size and block size from ``vllm:cache_config_info``'s labels.
- ``step``: rates between two scrapes (tokens/s, steps/s from ``vllm:iteration_tokens_total``'s
  count, preemptions and finishes in the window) and that histogram, cumulative.
- ``latency``: the cumulative histograms as scraped, and p50/p90/p99 over the last
  ``window_s`` estimated from the bucket deltas (as Prometheus's ``histogram_quantile``);
  with ``window_s`` 0 (``top --once``), from one scrape's cumulative histograms (since start).
  A quantile that falls in the first bucket, the +Inf bucket, or a bucket more than twice as
  wide as its lower edge is known only as a bound, so it also carries ``pNN_bound``:
  ``{"lo", "hi"}`` (``hi`` null for +Inf) — the screens show ``< 300ms`` / ``> 10s`` /
  ``100–250ms`` for it, never the interpolated number as if it were measured.
- ``config``: ``vllm:cache_config_info``'s labels, read-only (vLLM has no runtime config API).
- ``health``: ``running`` or ``idle`` from the queues (``sleeping`` from
  ``vllm:engine_sleep_state``), steps from the iteration histogram's count.

Robustness: a NaN or infinite gauge reads as missing; a counter or histogram that went down (the
server restarted) restarts the window and the rates instead of showing negative values; a
series an older vLLM lacks is simply absent (``None`` in the payload).
"""

from __future__ import annotations

import bisect
import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vconsole.console.sources.prom_text import families
from vconsole.telemetry import schema
from vconsole.telemetry.vllm_names import LATENCY_HISTOGRAMS

SOURCE = "vllm"
WINDOW_S = 60.0
NOT_EXPOSED = {
    "sched": ["requests", "num_preempted", "max_num_seqs", "max_num_batched_tokens", "policy"],
    "kv": ["block_states", "token_usage", "fragmentation", "num_shared"],
    "step": ["phase_s", "step_time_p50_s", "step_time_max_s", "sched_share"],
}
# Older or newer names of the same series: the first one present wins.
ALIASES: dict[str, tuple[str, ...]] = {
    "vllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "vllm:prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "vllm:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                         "vllm:time_per_output_token_seconds"),
}
ITERATION = "vllm:iteration_tokens_total"


@dataclass
class Histogram:
    bounds: list[float] = field(default_factory=list)     # ascending, the last +Inf
    counts: list[float] = field(default_factory=list)     # cumulative
    count: float = 0.0
    total: float = 0.0

    def wire(self) -> dict[str, Any]:
        return {"bounds": self.bounds, "counts": [int(c) for c in self.counts],
                "count": int(self.count), "sum": self.total}


@dataclass
class EngineSample:
    """One engine's series of one scrape: plain values, labelled values, histograms."""

    values: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, dict[str, float]] = field(default_factory=dict)   # name -> label -> v
    histograms: dict[str, Histogram] = field(default_factory=dict)
    info: dict[str, dict[str, str]] = field(default_factory=dict)         # *_info labels
    model: str | None = None                                              # model_name label

    def get(self, name: str) -> float | None:
        return _aliased(self.values, name)

    def hist(self, name: str) -> Histogram | None:
        return _aliased(self.histograms, name)


def _aliased(table: dict[str, Any], name: str) -> Any:
    """``table[name]``, or under the first of its other names (`ALIASES`) that is there."""
    for alias in ALIASES.get(name, (name,)):
        found = table.get(alias)
        if found is not None:
            return found
    return None


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _bound(le: str) -> float:
    return math.inf if le in ("+Inf", "Inf", "inf") else float(le)


def parse(text: str) -> dict[str, EngineSample]:
    """The ``vllm:*`` series of one scrape by ``engine`` label ("0" when there is none).
    Raises ``ValueError`` for text that is not the Prometheus exposition format."""
    out: dict[str, EngineSample] = {}
    for fam in families(text):
        if not fam.name.startswith("vllm:"):
            continue
        for s in fam.samples:
            labels = dict(s.labels)
            eng = out.setdefault(labels.pop("engine", "0"), EngineSample())
            model = labels.pop("model_name", None)
            if model:
                eng.model = model
            if fam.type == "histogram":
                h = eng.histograms.setdefault(fam.name, Histogram())
                if s.name.endswith("_bucket"):
                    h.bounds.append(_bound(labels.get("le", "+Inf")))
                    h.counts.append(s.value)
                elif s.name.endswith("_count"):
                    h.count = s.value
                elif s.name.endswith("_sum"):
                    h.total = s.value if math.isfinite(s.value) else 0.0
            elif fam.name.endswith("_info"):
                eng.info[fam.name] = labels
            elif labels:   # one extra label (finished_reason, sleep_state, reason, ...)
                key = next(iter(labels.values()))
                if (v := _finite(s.value)) is not None:
                    eng.labelled.setdefault(fam.name, {})[key] = v
            elif (v := _finite(s.value)) is not None:
                eng.values[fam.name] = v
    for eng in out.values():
        for h in eng.histograms.values():
            pairs = sorted(zip(h.bounds, h.counts, strict=True))
            h.bounds, h.counts = [b for b, _ in pairs], [c for _, c in pairs]
            if not h.bounds or h.bounds[-1] != math.inf:
                h.bounds.append(math.inf)
                h.counts.append(h.count)
    return out


def _bucket_of(q: float, counts: list[float]) -> int | None:
    """The index of the bucket the ``q`` quantile of cumulative ``counts`` falls in."""
    if not counts or counts[-1] <= 0:
        return None
    return min(bisect.bisect_left(counts, q * counts[-1]), len(counts) - 1)


def quantile_bound(q: float, bounds: list[float], counts: list[float]
                   ) -> dict[str, float | None] | None:
    """``{"lo", "hi"}`` when the ``q`` quantile is known only as a bound, else None: it falls in
    the first bucket (``< hi``), in +Inf (``> lo``, ``hi`` None), or in a bucket wider than the
    figure's own scale (``hi > 2 * lo``), where an interpolated number would read as measured
    to digits the histogram does not have."""
    i = _bucket_of(q, counts)
    if i is None:
        return None
    lo = bounds[i - 1] if i > 0 else 0.0
    hi = bounds[i]
    if hi == math.inf:
        return {"lo": lo, "hi": None}
    if i == 0 or lo <= 0 or hi > 2 * lo:
        return {"lo": lo if i > 0 else 0.0, "hi": hi}
    return None


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus's ``histogram_quantile``: the ``q`` quantile of cumulative bucket counts,
    linear within the bucket it falls in (the last finite bound when it falls in +Inf)."""
    i = _bucket_of(q, counts)
    if i is None:
        return None
    rank = q * counts[-1]
    if bounds[i] == math.inf:
        finite = [b for b in bounds if b != math.inf]
        return finite[-1] if finite else None
    lo = bounds[i - 1] if i > 0 else 0.0
    below = counts[i - 1] if i > 0 else 0.0
    inside = counts[i] - below
    if inside <= 0:
        return bounds[i]
    return lo + (bounds[i] - lo) * (rank - below) / inside


def window_stats(now_h: Histogram, then_h: Histogram | None) -> dict[str, Any]:
    """``{"count", "p50", "p90", "p99"}`` of the observations between two scrapes, and
    ``pNN_bound`` beside each quantile known only as a bound (`quantile_bound`)."""
    if then_h is not None and then_h.bounds == now_h.bounds:
        counts = [a - b for a, b in zip(now_h.counts, then_h.counts, strict=True)]
    else:
        counts = list(now_h.counts)
    n = counts[-1] if counts else 0
    out: dict[str, Any] = {"count": int(n)}
    for q in (0.5, 0.9, 0.99):
        name = f"p{int(q * 100)}"
        out[name] = quantile(q, now_h.bounds, counts)
        bound = quantile_bound(q, now_h.bounds, counts)
        if bound is not None:
            out[f"{name}_bound"] = bound
    return out


# Counter families (the parser strips ``_total`` from a counter family's name, as prometheus_client).
_COUNTERS = frozenset({"vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
                       "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                       "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"})


def _went_down(now: EngineSample, then: EngineSample) -> bool:
    """A counter or a histogram's count fell: the server restarted since ``then``."""
    for name in _COUNTERS:
        a, b = now.values.get(name), then.values.get(name)
        if a is not None and b is not None and a < b:
            return True
    return any(n in now.histograms and now.histograms[n].count < h.count
               for n, h in then.histograms.items())


@dataclass
class _Engine:
    """What the translator remembers of one engine between scrapes."""

    history: deque[tuple[float, EngineSample]] = field(default_factory=deque)
    seq: dict[str, int] = field(default_factory=dict)
    first_ts: float = 0.0

    def next_seq(self, topic: str) -> int:
        n = self.seq.get(topic, 0)
        self.seq[topic] = n + 1
        return n


class VllmTranslator:
    """Scrapes in, telemetry messages out (see the module docstring). ``name``: the engine name
    the console shows (the server's address); ``interval_s``: the scrape period, announced as
    the heartbeat interval so a missed scrape or two shows the engine down as for ours."""

    source_kind = SOURCE    # the messages' ``source``: the kind of server they come from

    def __init__(self, name: str, *, interval_s: float = 1.0, window_s: float = WINDOW_S) -> None:
        self.name = name
        # rank -> the prefix cache as the KV event stream says (`console.sources.kv_events`)
        self.prefix_cache: Callable[[int], dict[str, Any] | None] | None = None
        self.interval_s = interval_s
        self.window_s = window_s
        self._engines: dict[str, _Engine] = {}

    def translate(self, text: str, now: float | None = None) -> list[list[schema.Buffer]]:
        now = time.time() if now is None else now
        frames: list[list[schema.Buffer]] = []
        for label, sample in sorted(self.parse(text).items(), key=lambda kv: _rank_of(kv[0])):
            frames.extend(self._engine_messages(label, sample, now))
        return frames

    def parse(self, text: str) -> dict[str, EngineSample]:
        """One scrape's series by engine, under vLLM's names (another kind maps its own)."""
        return parse(text)

    def local(self, topic: str, body: dict[str, Any], now: float | None = None
              ) -> list[list[schema.Buffer]]:
        """``topic`` messages with ``body`` for every engine seen so far: readings taken on
        this machine (the GPU panel's NVML reading when the server runs here too)."""
        now = time.time() if now is None else now
        return [schema.encode(topic, {**schema.make_envelope(self.name, _rank_of(label),
                                                             e.next_seq(topic), now),
                                      "source": "local", **body})
                for label, e in sorted(self._engines.items(), key=lambda kv: _rank_of(kv[0]))]

    def _engine_messages(self, label: str, s: EngineSample, now: float
                         ) -> Iterable[list[schema.Buffer]]:
        e = self._engines.setdefault(label, _Engine(first_ts=now))
        if e.history and _went_down(s, e.history[-1][1]):
            e.history.clear()
            e.first_ts = now
        prev = e.history[-1] if e.history else None
        e.history.append((now, s))
        while len(e.history) > 2 and e.history[1][0] <= now - self.window_s:
            e.history.popleft()
        oldest = e.history[0][1] if len(e.history) > 1 else None
        rank = _rank_of(label)
        bodies = {
            "health": self._health(s, e, now),
            "step": self._step(s, prev, now),
            "sched": self._sched(s),
            "kv": self._kv(s, rank),
            "latency": self._latency(s, oldest),
            "config": self._config(s),
        }
        for topic, body in bodies.items():
            if body is None:
                continue
            env = schema.make_envelope(self.name, rank, e.next_seq(topic), now)
            yield schema.encode(topic, {**env, "source": self.source_kind, **body})

    # --- one body per topic ----------------------------------------------------------------

    def _health(self, s: EngineSample, e: _Engine, now: float) -> dict[str, Any]:
        it = s.hist(ITERATION)
        sleep = s.labelled.get("vllm:engine_sleep_state", {})
        sleeping = any(v and k != "awake" for k, v in sleep.items())
        busy = (s.get("vllm:num_requests_running") or 0) + (s.get("vllm:num_requests_waiting")
                                                            or 0)
        state = "sleeping" if sleeping else ("running" if busy else "idle")
        return {"state": state, "uptime_s": now - e.first_ts,
                "steps": int(it.count) if it else 0, "interval_s": self.interval_s,
                "pid": None, "alerts_active": {}, "restart_count": 0, "model": s.model,
                "sleep_state": next((k for k, v in sleep.items() if v), None)}

    def _step(self, s: EngineSample, prev: tuple[float, EngineSample] | None,
              now: float) -> dict[str, Any]:
        it = s.hist(ITERATION)
        body: dict[str, Any] = {
            "steps": 0, "window_s": 0.0, "phase_s": None, "step_time_p50_s": None,
            "step_time_max_s": None, "num_prefill_tokens": 0, "num_decode_tokens": 0,
            "tokens_per_s": None, "steps_per_s": None, "sched_share": None,
            "num_preempted": 0, "num_finished": 0, "not_exposed": NOT_EXPOSED["step"],
        }
        if it is not None:
            body["iteration_tokens"] = it.wire()
        if prev is None:
            return body
        t0, p = prev
        dt = max(now - t0, 1e-9)

        def delta(name: str) -> int:
            a, b = s.get(name), p.get(name)
            return int(a - b) if a is not None and b is not None and a >= b else 0

        pit = p.hist(ITERATION)
        steps = int(it.count - pit.count) if it and pit and it.count >= pit.count else 0
        prompt, gen = delta("vllm:prompt_tokens"), delta("vllm:generation_tokens")
        fin_now = s.labelled.get("vllm:request_success", {})
        fin_then = p.labelled.get("vllm:request_success", {})
        body.update(steps=steps, window_s=dt, num_prefill_tokens=prompt, num_decode_tokens=gen,
                    tokens_per_s=(prompt + gen) / dt, steps_per_s=steps / dt,
                    num_preempted=delta("vllm:num_preemptions"),
                    num_finished=int(max(0.0, sum(fin_now.values()) - sum(fin_then.values()))))
        return body

    def _sched(self, s: EngineSample) -> dict[str, Any]:
        fin = s.labelled.get("vllm:request_success", {})
        return {
            "num_waiting": _int(s.get("vllm:num_requests_waiting")),
            "num_running": _int(s.get("vllm:num_requests_running")),
            "num_preempted": None,
            "num_preemptions_total": _int(s.get("vllm:num_preemptions")),
            "num_finished_total": int(sum(fin.values())) if fin else None,
            "num_prompt_tokens_total": _int(s.get("vllm:prompt_tokens")),
            "num_generation_tokens_total": _int(s.get("vllm:generation_tokens")),
            "waiting_by_reason": {k: int(v) for k, v in s.labelled.get(
                "vllm:num_requests_waiting_by_reason", {}).items()},
            "max_num_seqs": None, "max_num_batched_tokens": None, "policy": None,
            "requests": [], "requests_truncated": False, "not_exposed": NOT_EXPOSED["sched"],
        }

    def _kv(self, s: EngineSample, rank: int) -> dict[str, Any]:
        cache = _cache_info(s)
        events = self.prefix_cache(rank) if self.prefix_cache is not None else None
        blocks = _int(_num(cache.get("num_gpu_blocks")))
        bs = _int(_num(cache.get("block_size")))
        usage = s.get("vllm:kv_cache_usage_perc")
        used = round(usage * blocks) if usage is not None and blocks else None
        queries, hits = s.get("vllm:prefix_cache_queries"), s.get("vllm:prefix_cache_hits")
        return {
            "num_blocks": blocks, "block_size": bs,
            "num_free": blocks - used if used is not None and blocks else None,
            # num_cached stays unknown: ours counts free blocks holding a prefix, the KV events'
            # set (``prefix_cache``) holds every block with a hash, in use or not.
            "num_used": used, "num_cached": None, "num_shared": None, "usage": usage,
            "token_usage": None, "fragmentation": None,
            "prefix_queries": _int(queries), "prefix_hits": _int(hits),
            "prefix_hit_rate": hits / queries if queries and hits is not None else 0.0,
            # vLLM's configured cache dtype (``auto``, ``fp8``, ...); bytes per token unknown.
            "cache_dtype": cache.get("cache_dtype") or None, "bytes_per_token": None,
            "capacity_tokens": blocks * bs if blocks is not None and bs else None,
            "pool_bytes": None,
            "not_exposed": NOT_EXPOSED["kv"],
            **({"prefix_cache": events} if events else {}),
        }

    def _latency(self, s: EngineSample, oldest: EngineSample | None) -> dict[str, Any]:
        hists: dict[str, Any] = {}
        window: dict[str, Any] = {}
        for series, (name, _doc) in LATENCY_HISTOGRAMS.items():
            h = s.hist(name)
            if h is None:
                continue
            hists[series] = h.wire()
            then = oldest.hist(name) if oldest is not None and self.window_s > 0 else None
            window[series] = window_stats(h, then)
        fin = s.labelled.get("vllm:request_success", {})
        return {"window_s": self.window_s, "overall": {"histograms": hists, "window": window},
                "priority": {}, "finished": {k: int(v) for k, v in fin.items()}}

    def _config(self, s: EngineSample) -> dict[str, Any] | None:
        cache = _cache_info(s)
        if not cache:
            return None
        return readonly_config({k: _typed(v) for k, v in sorted(cache.items())},
                               "vLLM cache config (vllm:cache_config_info); read-only")


def readonly_config(values: dict[str, Any], description: str) -> dict[str, Any]:
    """A ``config`` body of what a server says of its settings: shown, never changed."""
    rows = [{"key": k, "type": type(v).__name__ if v is not None else "str", "hot": False,
             "description": description, "min": None, "max": None, "choices": None,
             "nullable": True, "default": None} for k, v in values.items()]
    return {"version": 0, "values": values, "schema": rows, "readonly": True}


def _cache_info(s: EngineSample) -> dict[str, str]:
    return s.info.get("vllm:cache_config_info") or s.info.get("vllm:cache_config") or {}


def _rank_of(label: str) -> int:
    try:
        return int(label)
    except ValueError:
        return zlib.crc32(label.encode()) % 1000   # a non-numeric label still gets a stable rank


def _int(v: float | None) -> int | None:
    return int(v) if v is not None else None


def _num(text: str | None) -> float | None:
    try:
        v = float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def _typed(text: str) -> Any:
    """A label value as the config screen shows it: bool, int, float, null or the string."""
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    if text in ("None", ""):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
