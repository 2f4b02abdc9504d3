"""`apply_token_bitmask`: the same logits as a plain per-token rule, whatever rows, widths and
dtype; and the bitmask llguidance fills means what the sampler reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vconsole.engine.worker.sampler import apply_token_bitmask


def reference(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.numpy()
    for j, r in enumerate(rows):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= words.shape[1] or not (int(words[j, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, words", [(259, 9), (300, 9), (250, 9), (64, 2)])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], [1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_per_token_rule(vocab: int, words: int, rows: list[int],
                                    dtype: torch.dtype) -> None:
    rng = np.random.default_rng(vocab + len(rows))
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (len(rows), words), dtype=np.int64)
                               .astype(np.int32))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = reference(logits, rows, bitmask)
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, want)
