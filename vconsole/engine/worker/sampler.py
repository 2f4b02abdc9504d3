"""Batched token sampling on the model's device: greedy, temperature, top-k, top-p, min-p,
seeds, presence / frequency / repetition penalties and min_tokens.

Each row has its own parameters (as tensors, so one set of kernels serves the whole batch).
Sampling uses the exponential-race trick: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. is a
draw from ``probs``, and it turns "sample" into "draw noise, then argmax", which lets a seeded
row bring its own noise.

Structured outputs: `apply_token_bitmask` keeps, in place, only the tokens a constrained row's
grammar allows (`vconsole.engine.sched.output.GrammarBatch`), before anything else reads the
logits (so logprobs are those of the masked logits).

Seeds: a row whose request has a ``seed`` draws its noise from a generator seeded by
``(seed, number of output tokens so far)``. Its token therefore depends only on its own logits
and that pair: not on which other requests share the batch, nor on whether the request was
preempted and recomputed in between. Unseeded rows share the runner's generator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vconsole.engine.sched.output import GrammarBatch
from vconsole.wire.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): well-spread, deterministic generator seeds per token."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class Penalties:
    """Per-row penalties of one step (rows without any: presence 0, frequency 0, repetition 1)."""

    presence: torch.Tensor           # (S, 1) float32
    frequency: torch.Tensor          # (S, 1) float32
    repetition: torch.Tensor         # (S, 1) float32
    output_counts: torch.Tensor      # (S, V) float32: times each token was output so far
    seen: torch.Tensor               # (S, V) bool: in the prompt or the output

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's order: repetition (HF's rule: positive logits / r, negative x r) on every
        token seen, then frequency x count and presence once per output token."""
        x = logits.float()
        scaled = torch.where(x > 0, x / self.repetition, x * self.repetition)
        x = torch.where(self.seen, scaled, x)
        return x - self.frequency * self.output_counts \
            - self.presence * (self.output_counts > 0).float()


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the device.

    The flags (``all_greedy`` …) are plain bools computed on the host, so the sampler skips
    whole stages without looking at device tensors; a step whose requests use none of
    min_p, min_tokens and the penalties runs exactly the stages it ran before they existed.
    """

    temperature: torch.Tensor        # (S,) float32; 1.0 on greedy rows (unused there)
    top_k: torch.Tensor | None       # (S,) int64, vocab size where off; None if no row uses it
    top_p: torch.Tensor | None       # (S,) float32, 2.0 where off; None if no row uses it
    greedy: torch.Tensor | None      # (S,) bool; None when no row is greedy
    all_greedy: bool
    seeded: list[tuple[int, int]]    # (row, generator seed) for rows with their own seed
    min_p: torch.Tensor | None = None          # (S,) float32, 0 where off
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids)
    penalties: Penalties | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], num_output_tokens: Sequence[int],
              vocab_size: int, device: torch.device, *,
              token_ids: Sequence[Sequence[int]] = (), num_prompt_tokens: Sequence[int] = (),
              eos_token_ids: Sequence[int] = ()) -> SamplingBatch:
        """``token_ids`` (prompt then output, per row) and ``num_prompt_tokens`` are read only
        when a row has penalties; ``eos_token_ids`` when one has ``min_tokens``."""
        banned = [(i, [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size])
                  for i, (p, n) in enumerate(zip(params, num_output_tokens, strict=True))
                  if n < p.min_tokens]
        penalties = (_penalties(params, token_ids, num_prompt_tokens, vocab_size, device)
                     if any(p.penalised for p in params) else None)
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        if all_greedy:
            return cls(torch.ones(0), None, None, None, True, [], banned=banned,
                       penalties=penalties)
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
            all_greedy=False, seeded=seeded,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0.0 for p in params) else None,
            banned=banned, penalties=penalties)


def _penalties(params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
               num_prompt_tokens: Sequence[int], vocab_size: int,
               device: torch.device) -> Penalties:
    rows = len(params)
    counts = torch.zeros(rows, vocab_size, dtype=torch.float32)
    seen = torch.zeros(rows, vocab_size, dtype=torch.bool)
    for i, (p, ids, n_prompt) in enumerate(zip(params, token_ids, num_prompt_tokens,
                                               strict=True)):
        if not p.penalised:
            continue
        out = torch.tensor(ids[n_prompt:], dtype=torch.int64)
        counts[i].index_add_(0, out, torch.ones(len(out)))
        seen[i, torch.tensor(ids, dtype=torch.int64)] = True
    column = [[p.presence_penalty] for p in params], [[p.frequency_penalty] for p in params], \
        [[p.repetition_penalty] for p in params]
    presence, frequency, repetition = (torch.tensor(c, dtype=torch.float32, device=device)
                                       for c in column)
    return Penalties(presence, frequency, repetition, counts.to(device), seen.to(device))


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor
                        ) -> None:
    """In place: row ``rows[j]`` of ``logits`` (S, V) keeps the tokens row ``j`` of
    ``bitmask`` allows (int32 (len(rows), words) on the CPU, llguidance's layout: token ``t``
    is bit ``t % 32`` of word ``t // 32``) and is -inf elsewhere, tokens past the bitmask's
    width included (a model's vocabulary may be wider than its tokenizer's).

    One vectorised pass for all rows. On a CPU with float32 logits, branch-free integer
    arithmetic: numpy unpacks the bits (``unpackbits``, little bit order: the int32 words'
    bytes are little-endian) into a lane mask m (0 allowed, -1 banned) and each logit's bits
    become ``(x & ~m) | (-inf & m)``, in torch's in-place integer ops (its threads; numpy's
    were one thread: 1.5-2x slower on 32 rows of a 49k vocabulary). ``masked_fill_`` costs
    what the scatter of the allowed tokens makes its branches cost (up to 2x more on a
    random half). Elsewhere ``masked_fill_`` on the device after one copy of the (small)
    bitmask."""
    n, vocab = len(rows), logits.shape[-1]
    identity = n == logits.shape[0] and all(r == j for j, r in enumerate(rows))
    index = None if identity else torch.tensor(rows, dtype=torch.int64, device=logits.device)
    target = logits if index is None else logits.index_select(0, index)
    width = min(vocab, 32 * bitmask.shape[1])
    if target.device.type == "cpu" and target.dtype == torch.float32 \
            and target.is_contiguous():
        lanes = torch.from_numpy(np.unpackbits(
            bitmask.numpy().view(np.uint8), axis=1, count=width, bitorder="little")
        ).to(torch.int32).sub_(1)                      # 0 allowed, -1 banned
        x = target[:, :width].view(torch.int32)
        x.bitwise_and_(lanes.bitwise_not())
        x.bitwise_or_(lanes.bitwise_and_(_NEG_INF_BITS))
    else:
        mask = bitmask.to(target.device, non_blocking=True)
        shifts = torch.arange(32, device=target.device, dtype=torch.int32)
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :width]
        target[:, :width].masked_fill_(allowed == 0, float("-inf"))
    if width < vocab:
        target[:, width:] = float("-inf")
    if index is not None:
        logits[index] = target


_NEG_INF_BITS = np.array(np.float32(-np.inf)).view(np.int32).item()


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return one token id per row of ``logits`` (S, V), as an int64 tensor on the device.
        Penalties and ``min_tokens``' ban apply to greedy rows too (as in vLLM)."""
        logits = self.processed(logits, batch)
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        probs = self.probabilities(logits, batch)
        noise = self._noise(probs, batch)
        sampled = probs.div_(noise).argmax(dim=-1)
        if batch.greedy is not None:
            sampled = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits after the penalties and ``min_tokens``' ban (the same tensor when no row
        has either)."""
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
        if batch.banned:
            logits = logits.clone() if batch.penalties is None else logits
            for row, tokens in batch.banned:
                logits[row, tokens] = float("-inf")
        return logits

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
        probs = x.softmax(dim=-1)
        if batch.min_p is not None:
            # Drop what is less likely than min_p x the top token; the top token always stays.
            floor = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[int],
                 top: Sequence[int]) -> list[tuple[float, list[int], list[float]]]:
        """For each of ``rows``: the sampled token's logprob and the ``top[i]`` most likely
        tokens with theirs, from the raw logits (before temperature, penalties or filters, as
        vLLM's default; a structured-output row's logits are already masked by its grammar),
        in one batched log-softmax and top-k. A top list holds no token of logprob -inf (a
        grammar that allows fewer tokens than asked lists fewer)."""
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        lp = logits.index_select(0, index).float().log_softmax(dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1).tolist()
        k = max(top)
        top_lp, top_ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
        out = []
        for j, n in enumerate(top):
            ids, lps = top_id_rows[j][:n], top_lp_rows[j][:n]
            if lps and lps[-1] == float("-inf"):     # sorted: only a masked tail is -inf
                keep = sum(1 for v in lps if v != float("-inf"))
                ids, lps = ids[:keep], lps[:keep]
            out.append((chosen[j], ids, lps))
        return out

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


def apply_grammar(logits: torch.Tensor, req_ids: Sequence[str], grammar: GrammarBatch) -> int:
    """Mask the constrained rows' logits (row i is request ``req_ids[i]``) with their grammar's
    bitmask, in place; returns the host time it took (ns)."""
    t0 = time.monotonic_ns()
    if grammar.ready is not None:
        grammar.ready.result()     # filled beside the forward: what is left of it counts
    where = grammar.rows
    pairs = [(i, where[rid]) for i, rid in enumerate(req_ids) if rid in where]
    if pairs:
        rows, mask_rows = zip(*pairs, strict=True)
        bitmask = grammar.bitmask
        if list(mask_rows) != list(range(bitmask.shape[0])):
            bitmask = bitmask.index_select(0, torch.tensor(mask_rows, dtype=torch.int64))
        apply_token_bitmask(logits, rows, bitmask)
    return time.monotonic_ns() - t0
