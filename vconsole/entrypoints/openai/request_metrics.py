"""vLLM's per-request size histograms, observed by `vconsole serve` as each request finishes:
``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
``vllm:request_params_max_tokens``, ``vllm:request_params_n``,
``vllm:request_prefill_kv_computed_tokens`` (prompt tokens less those the prefix cache served).

Why in the HTTP server and not the engine's exporter: these are the request's parameters and its
final counts, which the server holds when its samples end (the engine's final output carries the
cached-token count); observing them here costs the busy loop nothing. As vLLM's front end, a
request's ``n`` samples count as ``n`` requests (each its prompt, its output, its max_tokens) and
``n`` once. Labels: ``model_name`` (the served name); no ``engine``: under data parallel the
server does not know which rank ran a sample. Bounds: vLLM's 1-2-5 series up to the model's
``max_model_len`` (``n``: 1, 2, 5, 10, 20).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Histogram

N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(max_value: int) -> list[int]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def per_request_timing(timings: Mapping[str, float], num_generation_tokens: int
                       ) -> dict[str, float | None]:
    """vLLM's per-request timing metrics (``--enable-per-request-metrics``, the response's
    ``metrics``) from the engine's phases (`RequestOutput.timings`), as vLLM computes them
    from its scheduler stats: ``time_to_first_token_ms`` (first token - first scheduled),
    ``generation_time_ms`` (last token - first token), ``queue_time_ms``, ``mean_itl_ms``
    (generation time / (tokens - 1), from two tokens on), ``tokens_per_second`` (tokens /
    (last token - first scheduled)). A phase the request never reached is None."""
    def ms(key: str) -> float | None:
        v = timings.get(key)
        return None if v is None else v * 1e3

    decode, inference = timings.get("decode_s"), timings.get("inference_s")
    return {
        "time_to_first_token_ms": ms("prefill_s"),
        "generation_time_ms": ms("decode_s"),
        "queue_time_ms": ms("queue_s"),
        "mean_itl_ms": (decode * 1e3 / (num_generation_tokens - 1)
                        if decode is not None and num_generation_tokens > 1 else None),
        "tokens_per_second": (num_generation_tokens / inference
                              if inference is not None and inference > 0 else None),
    }


class RequestSizeMetrics:
    """The five histograms, in ``registry``, created at the first observation (the bounds need
    the engine's ``max_model_len``, known once the server has shaken hands)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._h: dict[str, Histogram] = {}

    def _histograms(self, max_model_len: int) -> dict[str, Histogram]:
        with self._lock:
            if not self._h:
                sizes = one_two_five(max(1, max_model_len))
                for name, doc, bounds in (
                        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                         sizes),
                        ("vllm:request_generation_tokens",
                         "Number of generation tokens processed.", sizes),
                        ("vllm:request_params_max_tokens",
                         "Histogram of the max_tokens request parameter.", sizes),
                        ("vllm:request_params_n", "Histogram of the n request parameter.",
                         list(N_BUCKETS)),
                        ("vllm:request_prefill_kv_computed_tokens",
                         "Histogram of new KV tokens computed during prefill (excluding "
                         "cached tokens).", sizes)):
                    self._h[name] = Histogram(name, doc, ["model_name"], buckets=bounds,
                                              registry=self._registry)
            return self._h

    def prime(self, model_name: str, max_model_len: int) -> None:
        """The histograms and the model's series made at once, all at zero, once the engine's
        ``max_model_len`` is known: Prometheus then scrapes their zero before the first
        request, so ``rate()`` sees the first observations too (a series first scraped with
        its requests already counted has no increase to rate until the next ones)."""
        for h in self._histograms(max_model_len).values():
            h.labels(model_name)

    def observe(self, model_name: str, max_model_len: int, *, num_prompt_tokens: int,
                max_tokens: int, generation_tokens: Sequence[int],
                cached_tokens: Sequence[int]) -> None:
        """One prompt's finished samples: their output lengths and prefix-cache hits."""
        h = {k: v.labels(model_name) for k, v in self._histograms(max_model_len).items()}
        h["vllm:request_params_n"].observe(len(generation_tokens))
        for generated, cached in zip(generation_tokens, cached_tokens, strict=True):
            h["vllm:request_prompt_tokens"].observe(num_prompt_tokens)
            h["vllm:request_generation_tokens"].observe(generated)
            h["vllm:request_params_max_tokens"].observe(max_tokens)
            h["vllm:request_prefill_kv_computed_tokens"].observe(
                max(0, num_prompt_tokens - cached))
