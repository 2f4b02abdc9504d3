"""llama.cpp's ``llama-server`` as the console's telemetry messages: ``/metrics``, ``/slots``,
``/props`` and ``/health``.

Names from llama.cpp's own sources (``tools/server/server-task.cpp``,
``server_task_result_metrics::to_metrics``, and ``tools/server/README.md``), unlabelled:
counters ``llamacpp:prompt_tokens_total`` (prompt tokens processed, cached ones excluded),
``prompt_tokens_cached_total``, ``prompt_seconds_total``, ``tokens_predicted_total``,
``tokens_predicted_seconds_total``, ``n_decode_total``; gauges ``requests_processing``,
``requests_deferred``, ``n_busy_slots_per_decode``. ``/metrics`` needs ``--metrics``.

llama.cpp has no KV metric any more and no latency histograms, so:
- KV use is **estimated** from ``GET /slots``: the tokens held by the slots that are
  processing (``n_prompt_tokens`` plus ``next_token.n_decoded``) over the sum of every slot's
  ``n_ctx``; the ``kv`` message says ``usage_estimated`` and the screens mark it.
- TTFT and ITL are unknown (None): the fleet shows ``–``, never a zero.
- ``/health`` answers 503 while the model loads: the source reports ``starting``.
The model is ``/props``' ``model_alias`` (else the file name of ``model_path``).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import urllib.error
import urllib.request
from typing import Any

from vconsole.console.sources.prom_text import families
from vconsole.console.sources.vllm import ScrapeError, VllmScraper
from vconsole.console.sources.vllm_metrics import EngineSample, VllmTranslator, readonly_config

PREFIX = "llamacpp:"
# llama.cpp family (a counter's ``_total`` dropped by the parser) -> the vLLM names read for it
NAMES: dict[str, tuple[str, ...]] = {
    "llamacpp:requests_processing": ("vllm:num_requests_running",),
    "llamacpp:requests_deferred": ("vllm:num_requests_waiting",),
    "llamacpp:prompt_tokens": ("vllm:prompt_tokens", "vllm:prefix_cache_queries"),
    "llamacpp:prompt_tokens_cached": ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
    "llamacpp:tokens_predicted": ("vllm:generation_tokens",),
    "llamacpp:n_decode": ("llamacpp:n_decode",),
}
NOT_EXPOSED = {
    "sched": ["requests", "num_preempted", "num_preemptions_total", "max_num_batched_tokens",
              "policy"],
    "kv": ["block_states", "num_blocks", "fragmentation", "num_shared", "prefix_cache"],
    "step": ["phase_s", "step_time_p50_s", "step_time_max_s", "sched_share"],
}


def parse(text: str) -> EngineSample:
    """The ``llamacpp:*`` series of one scrape under vLLM's names. ValueError for text that is
    not the Prometheus exposition format."""
    eng = EngineSample()
    for fam in families(text):
        for s in fam.samples:
            names = NAMES.get(fam.name)
            if names is None or s.name.endswith("_created") or not math.isfinite(s.value):
                continue
            for name in names:
                eng.values[name] = eng.values.get(name, 0.0) + s.value
    return eng


def slot_tokens(slot: dict[str, Any]) -> int:
    """Tokens a processing slot holds in its context: its prompt and what it decoded so far
    (``next_token`` is an object in the README, a one-element list in the server's code)."""
    if not slot.get("is_processing"):
        return 0
    nxt = slot.get("next_token")
    if isinstance(nxt, list):
        nxt = nxt[0] if nxt else {}
    decoded = nxt.get("n_decoded", 0) if isinstance(nxt, dict) else 0
    return int(slot.get("n_prompt_tokens") or 0) + int(decoded or 0)


def kv_estimate(slots: list[dict[str, Any]] | None, props: dict[str, Any] | None
                ) -> tuple[float | None, int | None]:
    """(estimated KV use, context tokens in all): the processing slots' tokens over the sum of
    the slots' ``n_ctx`` (from ``/props`` when ``/slots`` is off: ``total_slots`` ×
    ``default_generation_settings.n_ctx``, use unknown)."""
    if slots:
        cap = sum(int(s.get("n_ctx") or 0) for s in slots)
        used = sum(slot_tokens(s) for s in slots)
        return (min(1.0, used / cap) if cap else None), (cap or None)
    if props:
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        total = props.get("total_slots")
        if isinstance(n_ctx, int) and isinstance(total, int):
            return None, n_ctx * total
    return None, None


def model_of(props: dict[str, Any] | None) -> str | None:
    if not props:
        return None
    alias = props.get("model_alias")
    if isinstance(alias, str) and alias:
        return alias
    path = props.get("model_path")
    return os.path.basename(path) if isinstance(path, str) and path else None


class LlamaCppTranslator(VllmTranslator):
    """`VllmTranslator` over llama.cpp's names, with ``/slots`` and ``/props`` set beside each
    scrape's text (`LlamaCppScraper`)."""

    source_kind = "llama-cpp"

    def __init__(self, name: str, *, interval_s: float = 1.0, window_s: float = 60.0) -> None:
        super().__init__(name, interval_s=interval_s, window_s=window_s)
        self.slots: list[dict[str, Any]] | None = None
        self.props: dict[str, Any] | None = None

    def parse(self, text: str) -> dict[str, EngineSample]:
        eng = parse(text)
        eng.model = model_of(self.props)
        return {"0": eng}

    def _kv(self, s: EngineSample, rank: int) -> dict[str, Any]:
        body = super()._kv(s, rank)
        usage, cap = kv_estimate(self.slots, self.props)
        body.update(usage=usage, usage_estimated=True, capacity_tokens=cap, num_blocks=None,
                    block_size=None, num_used=None, num_free=None,
                    not_exposed=NOT_EXPOSED["kv"])
        return body

    def _sched(self, s: EngineSample) -> dict[str, Any]:
        body = super()._sched(s)
        total = (self.props or {}).get("total_slots")
        body.update(max_num_seqs=total if isinstance(total, int) else None,
                    num_preemptions_total=None, not_exposed=NOT_EXPOSED["sched"])
        return body

    def _config(self, s: EngineSample) -> dict[str, Any] | None:
        p = self.props
        if not p:
            return None
        gen = p.get("default_generation_settings") or {}
        values = {"model_path": p.get("model_path"), "model_alias": p.get("model_alias"),
                  "total_slots": p.get("total_slots"), "n_ctx": gen.get("n_ctx"),
                  "build_info": p.get("build_info")}
        return readonly_config(values, "llama-server's GET /props; read-only")

    def _step(self, s: EngineSample, prev: tuple[float, EngineSample] | None,
              now: float) -> dict[str, Any]:
        body = super()._step(s, prev, now)
        if prev is not None:
            a, b = s.get("llamacpp:n_decode"), prev[1].get("llamacpp:n_decode")
            dt = max(now - prev[0], 1e-9)
            steps = int(a - b) if a is not None and b is not None and a >= b else 0
            body.update(steps=steps, steps_per_s=steps / dt)
        body["not_exposed"] = NOT_EXPOSED["step"]
        return body


class LlamaCppScraper(VllmScraper):
    """One scrape: ``/health`` (503: loading, `starting`), then ``/metrics``, ``/slots`` and
    ``/props``. ``/slots`` or ``/props`` refused (``--no-slots``) only loses the estimate."""

    def __init__(self, url: str, *, interval_s: float = 1.0, timeout_s: float = 5.0,
                 window_s: float = 60.0) -> None:
        super().__init__(url, interval_s=interval_s, timeout_s=timeout_s, window_s=window_s)
        self.translator: LlamaCppTranslator = LlamaCppTranslator(
            self.translator.name, interval_s=interval_s, window_s=window_s)
        self.starting = False

    def _get_json(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.root + path, timeout=self.timeout_s) as resp:  # noqa: S310
                return json.loads(resp.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            return None

    def scrape(self, now: float | None = None) -> list[list[Any]]:
        try:
            with urllib.request.urlopen(self.root + "/health", timeout=self.timeout_s):  # noqa: S310
                self.starting = False
        except urllib.error.HTTPError as e:
            if e.code == 503:
                self.starting = True
                self.failures += 1
                raise ScrapeError(f"{self.root}/health: 503, loading the model") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            pass                      # /metrics below says what is wrong
        slots = self._get_json("/slots")
        props = self._get_json("/props")
        self.translator.slots = slots if isinstance(slots, list) else None
        self.translator.props = props if isinstance(props, dict) else None
        return super().scrape(now)
