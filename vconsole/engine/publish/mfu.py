"""Estimated FLOPs and memory traffic of each step: vLLM's ``--enable-mfu-metrics``
(``vllm/v1/metrics/perf.py``), for our dense Llama-shaped models on one device.

vLLM's analytic model, term for term (its attention, FFN and unembed components; no tensor or
pipeline parallelism, no sliding window, no MoE): a step is its rows, each ``n`` new tokens
attending to ``c = start + n`` positions, a prefill row when ``n > 1``. The `StepStats`
aggregates are exactly what the formulas need: T tokens, the prefill rows (count, tokens, sum
of c, sum of n x c: ``prefill_attention``) and the rest one token each (their sum of c is
``num_context_tokens`` minus the prefill rows'). Steps without tokens (a data-parallel dummy
step) count nothing, as vLLM's scheduler computes no ``perf_stats`` for them.

Computed on the publisher's side over the steps it drains (the busy loop pays nothing);
cumulative since the publisher started, like vLLM's counters. Steps dropped by the hand-off's
bounded buffer are not counted. A CPU engine's body also carries this machine's measured peaks
(`device_peak`), which the console's utilisation is a share of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vconsole.engine.publish.device_peak import Peaks, measure_peaks
from vconsole.shared.stats import StepStats


@dataclass(frozen=True)
class ModelDims:
    """`EngineCore.model_dims`: L layers, D hidden, q / kv heads, d head dim, DI FFN width,
    V vocabulary, and bytes per activation, weight and KV element."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    activation_bytes: float
    weight_bytes: float
    cache_bytes: float
    cpu: bool = False           # the engine runs on the CPU (its peaks can be measured here)

    @classmethod
    def of(cls, model_info: Mapping[str, Any]) -> ModelDims | None:
        """From `EngineCore.model_info` (None when it has no ``dims``: a stand-in core)."""
        dims = model_info.get("dims")
        if not isinstance(dims, Mapping):
            return None
        try:
            return cls(**{k: dims[k] for k in cls.__dataclass_fields__ if k in dims})
        except TypeError:
            return None


def step_perf(m: ModelDims, s: StepStats) -> tuple[int, int, int]:
    """(FLOPs, bytes read, bytes written) of one step, vLLM's per-GPU estimate."""
    T = s.num_prefill_tokens + s.num_decode_tokens
    if T <= 0:
        return 0, 0, 0
    L, D, q, kv, d = m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    DI, V = m.intermediate_size, m.vocab_size
    a, w, c = m.activation_bytes, m.weight_bytes, m.cache_bytes
    n_prefill = s.num_prefill_reqs                  # rows with n > 1
    decode_tokens = s.num_reqs - n_prefill          # rows with n == 1, one token each
    prefill_tokens = T - decode_tokens
    prefill_context = s.prefill_context_tokens
    decode_context = s.num_context_tokens - prefill_context
    token_context = s.prefill_attention + decode_context
    logits = n_prefill + decode_tokens

    flops = (2 * T * D * (q + 2 * kv) * d * L          # qkv_proj
             + 2 * T * D * q * d * L                   # out_proj
             + 2 * (2 * q * token_context * d * L)     # attn_qk + attn_av
             + 2 * D * 3 * DI * T * L                  # dense_ffn (SwiGLU)
             + 2 * logits * D * V)                     # unembed

    attn_input = 0.0
    if prefill_tokens > 0:
        attn_input += (prefill_tokens * q + 2 * prefill_context * kv) * d * a * L
    if decode_tokens > 0:
        attn_input += decode_tokens * q * d * a * L + 2 * decode_context * kv * d * c * L
    read = (int(T * D * a * L) + int(D * (q + 2 * kv) * d * w * L) + int(attn_input)
            + int(T * q * d * a * L) + int(q * d * D * w * L)            # attention
            + int(T * D * a * L) + int(2 * D * DI * w * L) + int(2 * T * DI * a * L)
            + int(T * DI * a * L) + int(D * DI * w * L)                  # FFN
            + int(logits * D * a) + int(D * V * w))                      # unembed

    write = (int(T * (q + 2 * kv) * d * a * L) + int(2 * T * kv * d * c * L)
             + int(T * D * a * L)                                        # attention
             + int(2 * T * DI * a * L) + int(T * DI * a * L) + int(T * D * a * L)   # FFN
             + int(logits * V * a))                                      # unembed
    return int(flops), read, write


class PerfCounters:
    """The three cumulative counters of one engine (publisher thread only). ``peaks``: this
    machine's, measured at the first window of a CPU engine (`device_peak`)."""

    def __init__(self, dims: ModelDims, measure: Callable[[], Peaks] | None = measure_peaks
                 ) -> None:
        self.dims = dims
        self.flops = self.read_bytes = self.write_bytes = 0
        self.peaks: Peaks | None = None
        self._measure = measure if dims.cpu else None

    def add(self, steps: Iterable[StepStats]) -> dict[str, Any]:
        """Count ``steps`` (one step window); returns the ``step`` topic's ``perf`` field:
        the totals since start and this window's own figures (``flops``, ``read_bytes``,
        ``write_bytes``: the console's rates are these over the window's length)."""
        if self._measure is not None:
            self.peaks, self._measure = self._measure(), None
        dims = self.dims
        flops, read, write = self.flops, self.read_bytes, self.write_bytes
        for s in steps:
            f, r, w = step_perf(dims, s)
            self.flops += f
            self.read_bytes += r
            self.write_bytes += w
        body: dict[str, Any] = {
            "flops_total": self.flops, "read_bytes_total": self.read_bytes,
            "write_bytes_total": self.write_bytes, "flops": self.flops - flops,
            "read_bytes": self.read_bytes - read, "write_bytes": self.write_bytes - write}
        if self.peaks is not None:
            body["peak_flops_per_s"] = self.peaks.flops_per_s
            body["peak_bytes_per_s"] = self.peaks.bytes_per_s
        return body
