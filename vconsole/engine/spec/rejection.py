"""Verification of one row's draft against the target model's logits at every draft position.

A row that drafted ``d_1 .. d_k`` after its last token ran ``k + 1`` positions; their logits
``L_0 .. L_k`` (``L_i`` predicts the token after ``d_i``, ``L_0`` the one after the last token)
decide what is kept:

* greedy: ``d_i`` is accepted while it is the argmax of ``L_{i-1}``; the first that is not is
  replaced by that argmax, and when all are accepted the argmax of ``L_k`` is a bonus token.
  Exactly the tokens plain greedy decoding gives, one forward for up to ``k + 1`` of them.
* sampled (speculative sampling, Leviathan et al.; vLLM's rejection sampler): with target
  probabilities ``p_i`` (temperature, top-k, top-p, min-p applied as the sampler does) and a
  draft that is a point mass (an n-gram lookup has no probabilities: vLLM's ``draft_probs``
  of None), ``d_i`` is accepted with probability ``min(1, p(d_i) / 1) = p(d_i)``; the first
  rejected position draws from the residual ``max(p - q, 0)``, i.e. ``p`` without ``d_i``,
  renormalised; all accepted: a bonus token from ``p_k``. Each emitted token is distributed
  exactly as the target's own sample would be.

Returns the emitted tokens: the accepted drafts then one more (``1 .. k + 1`` tokens). One
device -> host read per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """``logits`` (k + 1, V) of the row's positions; ``draft`` its k tokens."""
    target = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for d, t in zip(draft, target, strict=False):
        out.append(t)
        if d != t:
            return out
    out.append(target[len(draft)])
    return out


def verify_sampled(probs: torch.Tensor, draft: Sequence[int],
                   generator: torch.Generator) -> list[int]:
    """``probs`` (k + 1, V): the target's sampling distribution at each position (rows sum to
    1); ``draft`` the k drafted tokens; ``generator`` the row's randomness."""
    k = len(draft)
    device = probs.device
    index = torch.tensor(list(draft), dtype=torch.int64, device=device)
    p_draft = probs[:k].gather(1, index[:, None]).squeeze(1)
    u = torch.rand(k, generator=generator, device=device, dtype=probs.dtype)
    accepted = (u < p_draft).tolist()
    a = k if all(accepted) else accepted.index(False)
    if a < k:
        residual = probs[a].clone()
        residual[draft[a]] = 0.0
        total = residual.sum()
        if float(total) <= 0.0:      # p was a point mass on the draft: u < 1 accepts it
            residual = probs[a]
        else:
            residual /= total
        last = residual
    else:
        last = probs[k]
    token = int(torch.multinomial(last, 1, generator=generator).item())
    return [*draft[:a], token]
