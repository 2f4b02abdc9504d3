"""Batched token sampling on the model's device: greedy, temperature, top-k, top-p, seeds.

Each row has its own parameters (as tensors, so one set of kernels serves the whole batch).
Sampling uses the exponential-race trick: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. is a
draw from ``probs``, and it turns "sample" into "draw noise, then argmax", which lets a seeded
row bring its own noise.

Seeds: a row whose request has a ``seed`` draws its noise from a generator seeded by
``(seed, number of output tokens so far)``. Its token therefore depends only on its own logits
and that pair: not on which other requests share the batch, nor on whether the request was
preempted and recomputed in between. Unseeded rows share the runner's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vconsole.engine.request import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): well-spread, deterministic generator seeds per token."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the device.

    The flags (``all_greedy`` …) are plain bools computed on the host, so the sampler skips
    whole stages without looking at device tensors.
    """

    temperature: torch.Tensor        # (S,) float32; 1.0 on greedy rows (unused there)
    top_k: torch.Tensor | None       # (S,) int64, vocab size where off; None if no row uses it
    top_p: torch.Tensor | None       # (S,) float32, 2.0 where off; None if no row uses it
    greedy: torch.Tensor | None      # (S,) bool; None when no row is greedy
    all_greedy: bool
    seeded: list[tuple[int, int]]    # (row, generator seed) for rows with their own seed

    @classmethod
    def build(cls, params: Sequence[SamplingParams], num_output_tokens: Sequence[int],
              vocab_size: int, device: torch.device) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        if all_greedy:
            return cls(torch.ones(0), None, None, None, True, [])
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        use_k = any(0 < p.top_k < vocab_size for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        seeded = [(i, _mix_seed(p.seed, n)) for i, (p, n)
                  in enumerate(zip(params, num_output_tokens, strict=True))
                  if p.seed is not None and not greedy[i]]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size
                                for p in params], dtype=torch.int64, device=device)
            if use_k else None,
            # 2.0 rather than 1.0 where off, so float rounding of the cumsum never drops a token.
            top_p=torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                               dtype=torch.float32, device=device)
            if use_p else None,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device) if any(greedy) else None,
            all_greedy=False, seeded=seeded)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return one token id per row of ``logits`` (S, V), as an int64 tensor on the device."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        probs = self.probabilities(logits, batch)
        noise = self._noise(probs, batch)
        sampled = probs.div_(noise).argmax(dim=-1)
        if batch.greedy is not None:
            sampled = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Softmax of temperature-scaled logits after top-k/top-p filtering (float32, S x V).

        Rows are independent: each row's result depends on that row's logits and parameters
        only. Greedy rows get meaningless (but finite) values; the caller overrides them.
        """
        x = logits.float() / batch.temperature[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            sorted_x, order = x.sort(dim=-1, descending=True)
            if batch.top_k is not None:
                ranks = torch.arange(x.shape[-1], device=x.device)
                sorted_x.masked_fill_(ranks[None, :] >= batch.top_k[:, None], float("-inf"))
            if batch.top_p is not None:
                p = sorted_x.softmax(dim=-1)
                # Drop a token when the tokens ranked above it already reach top_p; the top
                # token is never dropped, so top_p -> 0 is greedy.
                drop = (p.cumsum(dim=-1) - p) >= batch.top_p[:, None]
                drop[:, 0] = False
                sorted_x.masked_fill_(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
        return x.softmax(dim=-1)

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(batch.seeded) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        vocab = probs.shape[-1]
        for row, seed in batch.seeded:
            g = torch.Generator(device=probs.device)
            g.manual_seed(seed)
            q[row] = torch.empty(vocab, dtype=probs.dtype, device=probs.device).exponential_(
                generator=g)
        # Exp(1) may return exactly 0 in float32; keep the race finite.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)
