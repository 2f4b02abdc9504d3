"""The batch shapes a step-time model was fitted on, and how much of a prediction leaves them.

A step's shape is what its cost depends on: the rows it runs, the context each row reads, and
the prefill chunk it computes. The model is linear in them, so inside the shapes it was fitted
on it interpolates; outside, it extrapolates, and its error there is unknown: a trace taken at
32 seats holds few 6-row steps, so the per-step constant that dominates a 6-row step is poorly
known (#44). A prediction therefore says which share of its simulated steps fell in shapes
the fit had too few steps of, and `vconsole whatif --calibrate` measures those shapes.

Shapes are bins, half an octave wide for rows (1, 2, 3, 4, 5-6, 7-8, 9-12, ...), an octave
for the context per row and the prefill chunk (0: a decode-only step). A bin is covered when
the fit saw at least `MIN_BIN_STEPS` steps in it, and at least `MIN_BIN_SHARE` of its steps
(the decode part and the prefill chunk counted apart: `Coverage`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from vconsole.telemetry.request_trace import StepRecord

MIN_BIN_STEPS = 20
MIN_BIN_SHARE = 0.002
OUTSIDE_WARN = 0.05     # a prediction with more of its steps outside says so

Shape = tuple[int, int, int]     # (rows bin, context-per-row bin, prefill bin)


def _half_octave(n: int) -> int:
    """1 -> 0, 2 -> 2, 3 -> 3, 4 -> 4, 5-6 -> 5, 7-8 -> 6, 9-12 -> 7, 13-16 -> 8, ..."""
    if n <= 0:
        return -1
    if n <= 4:
        return [0, 0, 2, 3, 4][n]
    k = math.floor(math.log2(n - 1))          # 5-8 -> 2, 9-16 -> 3
    upper_half = (n - 1) >= 3 * (1 << (k - 1))
    return 2 * k + 1 + int(upper_half)


def _octave(n: float) -> int:
    return 0 if n < 1 else 1 + int(math.log2(n))


def shape(step: StepRecord) -> Shape:
    rows = max(step.reqs, 1)
    return (_half_octave(step.reqs), _octave(step.context / rows), _octave(step.prefill))


def busy(steps: Iterable[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.prefill + s.decode > 0]


@dataclass(frozen=True)
class Coverage:
    """The shapes a model's fitting steps cover. The model is a sum of a decode part (rows,
    their context) and a prefill part (the chunk), so a step is covered when its rows and
    context per row were seen often enough (``decode``) and its prefill chunk was too
    (``prefill``), not necessarily in one step."""

    decode: dict[tuple[int, int], int]
    prefill: dict[int, int]
    total: int

    @classmethod
    def of(cls, steps: Iterable[StepRecord]) -> Coverage:
        shapes = [shape(s) for s in busy(steps)]
        return cls(dict(Counter((r, c) for r, c, _ in shapes)),
                   dict(Counter(p for _, _, p in shapes if p > 0)), len(shapes))

    def _enough(self, n: int) -> bool:
        return n >= MIN_BIN_STEPS and n >= MIN_BIN_SHARE * self.total

    def covered(self, sh: Shape) -> bool:
        rows, ctx, pf = sh
        return self._enough(self.decode.get((rows, ctx), 0)) and (
            pf <= 0 or self._enough(self.prefill.get(pf, 0)))

    def outside(self, steps: Iterable[StepRecord]) -> dict[str, object]:
        """How much of ``steps`` (a simulation's) the fit does not cover: ``share`` of the
        busy steps, ``steps``, ``examples``: the commonest uncovered shapes, described, and
        ``warn`` when the share is above `OUTSIDE_WARN`."""
        seen = Counter(shape(s) for s in busy(steps))
        total = sum(seen.values())
        out = Counter({sh: n for sh, n in seen.items() if not self.covered(sh)})
        n_out = sum(out.values())
        examples = [describe(sh) for sh, _ in out.most_common(3)]
        return {"share": round(n_out / total, 4) if total else 0.0, "steps": n_out,
                "examples": examples, "warn": bool(total) and n_out / total > OUTSIDE_WARN}


def _rows_range(b: int) -> str:
    if b <= 4:
        return str(max(b, 1))
    k = (b - 1) // 2
    lo_full, hi_full = (1 << k) + 1, 1 << (k + 1)
    mid = 3 * (1 << (k - 1))
    lo, hi = (mid + 1, hi_full) if (b - 1) % 2 else (lo_full, mid)
    return f"{lo}-{hi}" if lo != hi else str(lo)


def _range(b: int) -> str:
    if b <= 0:
        return "0"
    lo = 1 << (b - 1)
    return f"{lo}-{2 * lo - 1}"


def describe(sh: Shape) -> str:
    """``6 rows, 256-511 tokens of context each, decode only``."""
    rows, ctx, pf = sh
    chunk = "decode only" if pf <= 0 else f"a {_range(pf)}-token prefill chunk"
    n = _rows_range(rows)
    return f"{n} {'row' if n == '1' else 'rows'}, {_range(ctx)} tokens of context each, {chunk}"
