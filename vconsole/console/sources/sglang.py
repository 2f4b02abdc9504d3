"""An SGLang server's ``/metrics`` (``--enable-metrics``) as the console's telemetry messages.

SGLang's names are those of ``python/sglang/srt/observability/metrics_collector.py``
(`SchedulerMetricsCollector`: gauges labelled ``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank`` and ``dp_rank`` when data parallel; `TokenizerMetricsCollector`: counters and
histograms labelled ``model_name``, ``engine_type`` and ``is_streaming`` or ``cache_source``).
`parse` reads them into the same per-engine sample the vLLM reader fills, under vLLM's names
(`NAMES`), so `SglangTranslator` is `VllmTranslator` with another parser: every figure the
fleet and the screens show comes through one code path.

How SGLang's series map:
- queues: ``num_running_reqs``, ``num_queue_reqs`` (gauges);
- KV: ``token_usage`` (the share of the pool's tokens in use), ``num_used_tokens`` and
  ``max_total_num_tokens`` (the pool in tokens, SGLang has no blocks);
- prefix cache: ``cached_tokens_total`` over ``prompt_tokens_total`` (both in tokens, as vLLM's
  queries and hits);
- preemptions: SGLang retracts rather than preempts: ``num_retracted_requests_total``;
- latency: ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``queue_time_seconds`` with SGLang's own bucket bounds.

Gauges come from tensor-parallel rank 0 only (every rank of a group has the same queues);
counters and histograms are summed over their other labels (``is_streaming``,
``cache_source``, ``priority``). Engines are told apart by ``dp_rank``.
"""

from __future__ import annotations

import math
from typing import Any

from vconsole.console.sources.prom_text import families
from vconsole.console.sources.vllm_metrics import (
    EngineSample,
    Histogram,
    VllmTranslator,
    readonly_config,
)

PREFIX = "sglang:"
# SGLang family (prometheus_client drops a counter's ``_total``) -> the vLLM name read for it.
NAMES: dict[str, tuple[str, ...]] = {
    "sglang:num_running_reqs": ("vllm:num_requests_running",),
    "sglang:num_queue_reqs": ("vllm:num_requests_waiting",),
    "sglang:token_usage": ("vllm:kv_cache_usage_perc",),
    "sglang:num_used_tokens": ("sglang:num_used_tokens",),
    "sglang:max_total_num_tokens": ("sglang:max_total_num_tokens",),
    "sglang:cache_hit_rate": ("sglang:cache_hit_rate",),
    "sglang:gen_throughput": ("sglang:gen_throughput",),
    "sglang:prompt_tokens": ("vllm:prompt_tokens", "vllm:prefix_cache_queries"),
    "sglang:generation_tokens": ("vllm:generation_tokens",),
    "sglang:cached_tokens": ("vllm:prefix_cache_hits",),
    "sglang:num_retracted_requests": ("vllm:num_preemptions",),
    "sglang:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "sglang:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "sglang:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "sglang:queue_time_seconds": ("vllm:request_queue_time_seconds",),
}
FINISHED = "sglang:num_requests"           # counted as vLLM's request_success{reason="all"}
_RATIOS = frozenset({"sglang:token_usage", "sglang:cache_hit_rate"})   # never summed
NOT_EXPOSED = {
    "sched": ["requests", "num_preempted", "max_num_seqs", "max_num_batched_tokens", "policy"],
    "kv": ["block_states", "num_blocks", "fragmentation", "num_shared"],
    "step": ["phase_s", "step_time_p50_s", "step_time_max_s", "sched_share", "steps"],
}


def parse(text: str) -> dict[str, EngineSample]:
    """SGLang's series of one scrape by ``dp_rank`` ("0" without one), under vLLM's names.
    ValueError for text that is not the Prometheus exposition format."""
    out: dict[str, EngineSample] = {}
    for fam in families(text):
        if not fam.name.startswith(PREFIX) or (fam.name not in NAMES and fam.name != FINISHED):
            continue
        for s in fam.samples:
            labels = dict(s.labels)
            if labels.get("tp_rank", "0") != "0" and fam.type == "gauge":
                continue
            eng = out.setdefault(labels.get("dp_rank", "0"), EngineSample())
            if labels.get("model_name"):
                eng.model = labels["model_name"]
            if not math.isfinite(s.value):
                continue
            if fam.name == FINISHED:
                fin = eng.labelled.setdefault("vllm:request_success", {})
                fin["all"] = fin.get("all", 0.0) + s.value
            elif fam.type == "histogram":
                _add_bucket(eng, NAMES[fam.name][0], s.name, labels.get("le"), s.value)
            elif s.name.endswith("_created"):
                continue
            else:
                for name in NAMES[fam.name]:
                    if fam.name in _RATIOS:
                        eng.values[name] = max(eng.values.get(name, 0.0), s.value)
                    else:
                        eng.values[name] = eng.values.get(name, 0.0) + s.value
    for eng in out.values():
        for h in eng.histograms.values():
            pairs = sorted(zip(h.bounds, h.counts, strict=True))
            h.bounds, h.counts = [b for b, _ in pairs], [c for _, c in pairs]
    return out


def _add_bucket(eng: EngineSample, name: str, sample: str, le: str | None, v: float) -> None:
    """Sum a histogram's sample into ``eng`` (label sets of one family share their bounds)."""
    h = eng.histograms.setdefault(name, Histogram())
    if sample.endswith("_bucket") and le is not None:
        bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
        if bound in h.bounds:
            h.counts[h.bounds.index(bound)] += v
        else:
            h.bounds.append(bound)
            h.counts.append(v)
    elif sample.endswith("_count"):
        h.count += v
    elif sample.endswith("_sum"):
        h.total += v


class SglangTranslator(VllmTranslator):
    """`VllmTranslator` over SGLang's names (see the module docstring). The KV pool is in
    tokens (``max_total_num_tokens``), so its ``kv`` message has ``capacity_tokens`` and
    ``token_usage`` and no blocks."""

    source_kind = "sglang"

    def parse(self, text: str) -> dict[str, EngineSample]:
        return parse(text)

    def _kv(self, s: EngineSample, rank: int) -> dict[str, Any]:
        body = super()._kv(s, rank)
        cap = s.get("sglang:max_total_num_tokens")
        used = s.get("sglang:num_used_tokens")
        body.update(capacity_tokens=int(cap) if cap else None,
                    token_usage=s.get("vllm:kv_cache_usage_perc"),
                    num_used=None, num_free=None, not_exposed=NOT_EXPOSED["kv"],
                    used_tokens=int(used) if used is not None else None)
        return body

    def _step(self, s: EngineSample, prev: tuple[float, EngineSample] | None,
              now: float) -> dict[str, Any]:
        body = super()._step(s, prev, now)
        body["not_exposed"] = NOT_EXPOSED["step"]
        return body

    def _sched(self, s: EngineSample) -> dict[str, Any]:
        body = super()._sched(s)
        body["not_exposed"] = NOT_EXPOSED["sched"]
        body["preemptions_are"] = "retractions"
        return body

    def _config(self, s: EngineSample) -> dict[str, Any] | None:
        cap = s.get("sglang:max_total_num_tokens")
        values = {"model_name": s.model, "max_total_num_tokens": int(cap) if cap else None}
        return readonly_config(values, "SGLang's /metrics (SGLang has no runtime config API "
                                       "here); read-only")
