"""Model FLOPs and this machine's matmul peak: the model-FLOP utilisation of the throughput bench.

Useful FLOPs are the multiply-adds the model's math needs for the tokens it serves, counted the
way PaLM's MFU counts them (2 FLOPs per multiply-add), never what an implementation happens to
compute (a padded batch, a recomputed prefix, the LM head over rows nobody samples):

- every token fed through the decoder: ``2 x P_layers``, where ``P_layers`` is the parameters
  of the decoder layers' linears (q, k, v, o, gate, up, down; norms and biases are not
  matmuls);
- every sampled token: ``2 x vocab x hidden`` for the LM head (tied to the embedding or not:
  it is a matmul either way; the embedding lookup is not);
- attention, per layer, for a query at position ``p`` (it sees ``p + 1`` keys): ``2 x heads x
  head_dim x (p + 1)`` for QK and as much again for PV, so ``4 x L x H x hd x (p + 1)``.

A request of prompt ``P`` and output ``O`` served once (no preemption, no prefix reuse) feeds
``P + O - 1`` tokens (the last output is never fed back) and samples ``O``.

The peak is measured, not read from a datasheet: the best of a few ``torch.mm`` of large square
float32 matrices with the torch threads the bench runs with, on the same machine, in the same
run. It is what MKL reaches on this CPU, not the FMA units' theoretical rate (on the 2-core
development machine ~380 GFLOP/s against ~2 x 3 GHz x 64).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers Llama-family config."""
        heads = config.num_attention_heads
        return cls(num_layers=config.num_hidden_layers, hidden=config.hidden_size,
                   num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of every decoder layer's linears, all layers."""
        q = self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.num_layers * (q + kv + o + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def weight_bytes_per_token(self, bytes_per_weight: float) -> int:
        """The matmul weights one decode step of a single stream reads (every layer's linears
        and the LM head), at ``bytes_per_weight`` (4 float32, 1 int8; scales not counted)."""
        return int((self.layer_matmul_params + self.lm_head_params) * bytes_per_weight)

    def token_flops(self) -> int:
        """One token through the decoder's linears (no attention, no LM head)."""
        return 2 * self.layer_matmul_params

    def sample_flops(self) -> int:
        """The LM head for one sampled row."""
        return 2 * self.lm_head_params

    def attention_flops(self, start: int, num_tokens: int) -> int:
        """QK and PV of the queries at positions ``start .. start + num_tokens - 1``."""
        end = start + num_tokens
        keys = (end * (end + 1) - start * (start + 1)) // 2   # sum of p + 1 over the span
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        """Useful FLOPs of one request served once."""
        fed = prompt_len + output_len - 1
        return (fed * self.token_flops() + output_len * self.sample_flops()
                + self.attention_flops(0, fed))

    def step_flops(self, starts: Mapping[str, int], num_tokens: Mapping[str, int],
                   num_sampled: int) -> int:
        """Useful FLOPs of one engine step: each request's tokens from its start position, and
        ``num_sampled`` rows through the LM head."""
        total = num_sampled * self.sample_flops()
        for req_id, n in num_tokens.items():
            total += n * self.token_flops() + self.attention_flops(starts[req_id], n)
        return total


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """The best FLOP/s of ``repeats`` float32 ``torch.mm`` of two ``size`` x ``size`` matrices
    with torch's current threads (after one untimed call)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best
