"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the longest
suffix of the request's tokens (prompt + output), between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long.

A request that quotes its prompt (edit, summarise, extract) repeats runs of it, so the tokens
that followed the same n-gram last time are good guesses for the next ones; a free chat rarely
repeats and gets no draft (the step is then a plain decode, at no cost but the lookup).

The lookup is vectorised with numpy: the positions holding the last token are the candidates
for the end of a match, and each round of ``prompt_lookup_max - 1`` comparisons keeps those
whose match extends one token further back. O(L x max) in the worst case, typically far less
(only the positions equal to the last token are followed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts of at most ``k`` tokens from an n-gram of ``lo`` .. ``hi`` tokens."""

    def __init__(self, k: int, lo: int, hi: int) -> None:
        if not (k >= 1 and 1 <= lo <= hi):
            raise ValueError(f"need k >= 1 and 1 <= lo <= hi, got k={k} lo={lo} hi={hi}")
        self.k, self.lo, self.hi = k, lo, hi
        self.match_len = 0      # the last `propose`'s matched suffix (0: none)

    def propose(self, tokens: Sequence[int] | np.ndarray, max_tokens: int | None = None
                ) -> list[int]:
        """The draft for what follows ``tokens`` (at most ``max_tokens``, default ``k``);
        empty when no suffix of at least ``lo`` tokens occurred before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        self.match_len = 0
        arr = np.asarray(tokens, dtype=np.int64)
        n = arr.shape[0]
        if k <= 0 or n <= self.lo:
            return []
        last = n - 1
        # Candidates: earlier positions j (< last) holding the last token, so a match ending
        # at j has at least one token after it.
        cands = np.flatnonzero(arr[:last] == arr[last])
        if cands.size == 0:
            return []
        lengths = np.ones(cands.size, dtype=np.int64)
        alive = np.ones(cands.size, dtype=bool)
        for m in range(1, min(self.hi, last)):
            ok = alive & (cands >= m)
            if not ok.any():
                break
            ok[ok] = arr[cands[ok] - m] == arr[last - m]
            lengths += ok
            alive = ok
        best = int(lengths.max())
        if best < self.lo:
            return []
        j = int(cands[np.flatnonzero(lengths == best)[-1]])   # the latest of the longest
        self.match_len = best
        return arr[j + 1:j + 1 + k].tolist()
