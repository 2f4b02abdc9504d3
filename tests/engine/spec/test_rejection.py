"""Verification of a draft: greedy acceptance, and rejection sampling that leaves the target's
distribution unchanged (checked statistically on a small vocabulary, generous bounds)."""

from __future__ import annotations

import torch

from vconsole.engine.spec.rejection import verify_greedy, verify_sampled


def _onehot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    x = torch.zeros(len(tokens), vocab)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


def test_greedy_accepts_the_matching_prefix_then_corrects_or_adds_a_bonus():
    logits = _onehot_logits([3, 1, 4, 2])           # the target's argmax at 4 positions
    assert verify_greedy(logits, [3, 1, 4]) == [3, 1, 4, 2]   # all accepted + bonus
    assert verify_greedy(logits, [3, 1, 5]) == [3, 1, 4]      # third rejected: corrected
    assert verify_greedy(logits, [0, 1, 4]) == [3]            # first rejected
    assert verify_greedy(logits[:1], []) == [3]               # no draft: a plain decode


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(1234)
    vocab, trials = 5, 12000
    probs = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, dim=-1)
    draft = [int(probs[0].argmin()), int(probs[1].argmax())]    # a poor and a good guess
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)           # given the first draft token was accepted
    lengths = torch.zeros(3)
    for _ in range(trials):
        out = verify_sampled(probs, draft, g)
        assert 1 <= len(out) <= 3 and out[:len(out) - 1] == draft[:len(out) - 1]
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
        lengths[len(out) - 1] += 1
    # The first emitted token is a draw from p_0 whatever the draft proposed; after an
    # accepted d_1, the next one is a draw from p_1.
    assert _tv(first, probs[0]) < 0.03, (first / trials, probs[0])
    assert second.sum() > 200
    assert _tv(second, probs[1]) < 0.08, (second / second.sum(), probs[1])
    # Acceptance of the first draft token happens with probability p_0(d_1).
    accepted = float(lengths[1:].sum()) / trials
    assert abs(accepted - float(probs[0, draft[0]])) < 0.03


def test_a_certain_target_always_accepts_its_token():
    probs = torch.zeros(3, 4)
    probs[:, 2] = 1.0
    g = torch.Generator().manual_seed(0)
    assert verify_sampled(probs, [2, 2], g) == [2, 2, 2]
    assert verify_sampled(probs, [1, 2], g) == [2]
