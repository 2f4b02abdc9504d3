"""An interval per predicted figure, from the two things a prediction does not know.

1. **The step noise.** Each simulated step draws a residual from the trace's own spread
   (`StepCostModel.sampler`): another seed is another equally likely run. The runs at
   `SEEDS` bracket what the noise alone moves.
2. **The cost model's error at the shapes the prediction runs.** The fit's residuals say how
   well it matches the steps it saw; how well it matches steps of another shape is measured
   by holding shapes out (`shape_error`): the steps are grouped by their rows
   (`vconsole.whatif.coverage`); the groups of fewer rows are predicted by a model fitted on
   the groups of more, and the other way round (extrapolation, as a variant that leaves the
   trace's shapes does), each group's miss taken relative to how the same model does on what
   it was fitted on. ``inside``: the full fit's bias per group (a prediction whose steps stay
   in covered shapes); ``outside``: the held-out one (a prediction that leaves them). The
   model is run with every cost times 1 - error and 1 + error.

The interval of a figure is the smallest and largest of those runs, the central run among
them; ``stated`` is its half-width relative to the central figure, the error the report
states for that figure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from vconsole.telemetry.request_trace import FIGURES, StepRecord
from vconsole.whatif.cost_model import MIN_STEPS, StepCostModel, TooLittleTraffic, fit
from vconsole.whatif.coverage import busy, shape

SEEDS = (1, 2)
MIN_GROUP = 30           # a group of fewer steps is not judged on its own


def _total(model: StepCostModel, steps: list[StepRecord]) -> float:
    return sum(model.step_dur(s) for s in steps)


def _rms(errors: list[tuple[float, int]]) -> float:
    n = sum(w for _, w in errors)
    return math.sqrt(sum(e * e * w for e, w in errors) / n) if n else 0.0


def shape_error(steps: list[StepRecord], model: StepCostModel) -> dict[str, float]:
    """``inside`` / ``outside``: the step-time model's relative error on a group of steps of
    one shape (rows), as a step-weighted root mean square over the groups (see the module
    docstring); 0 with fewer than two groups to compare."""
    groups: dict[int, list[StepRecord]] = defaultdict(list)
    for s in busy(steps):
        groups[shape(s)[0]].append(s)
    judged = {g: ss for g, ss in groups.items() if len(ss) >= MIN_GROUP}
    allsteps = busy(steps)
    actual = sum(s.dur for s in allsteps)
    level = actual / max(_total(model, allsteps), 1e-12)
    inside = []
    for ss in judged.values():
        act = sum(s.dur for s in ss)
        inside.append((act / max(_total(model, ss), 1e-12) / level - 1.0, len(ss)))
    if len(judged) < 2:
        return {"inside": 0.0, "outside": 0.0}
    # Extrapolation, both ways: the groups below the middle predicted by a fit on those above
    # it, and the other way round (a variant leaves the trace's shapes at one end).
    order = sorted(judged)
    half = len(order) // 2
    outside = []
    for held_out, kept in ((order[:half], order[half:]), (order[half:], order[:half])):
        rest = [s for g in kept for s in judged[g]]
        if len(rest) < MIN_STEPS:
            continue
        try:
            held = fit(rest, model.native_rows)
        except TooLittleTraffic:
            continue
        lvl = sum(s.dur for s in rest) / max(_total(held, rest), 1e-12)
        for g in held_out:
            ss = judged[g]
            act = sum(s.dur for s in ss)
            outside.append((act / max(_total(held, ss), 1e-12) / lvl - 1.0, len(ss)))
    ins = _rms(inside)
    return {"inside": round(ins, 4), "outside": round(max(_rms(outside), ins), 4)}


def interval_runs(run: Callable[[StepCostModel, int], dict[str, Any]], model: StepCostModel,
                  error: float) -> list[dict[str, Any]]:
    """The figures of the runs that bracket a prediction (the central one not among them):
    ``run(model, seed)`` at each of `SEEDS`, and the model scaled by 1 -/+ ``error``."""
    out = [run(model, seed) for seed in SEEDS]
    if error > 0:
        out += [run(model.scaled(1.0 - error), 0), run(model.scaled(1.0 + error), 0)]
    return out


def interval(center: Mapping[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``{figure: [lo, hi]}`` over the central figures and ``runs``, and ``stated``: each
    figure's relative half-width (None where the central figure is 0 or missing)."""
    bounds: dict[str, list[float] | None] = {}
    stated: dict[str, float | None] = {}
    for k in FIGURES:
        vals = [f[k] for f in (center, *runs) if f.get(k) is not None]
        c = center.get(k)
        if not vals or c is None:
            bounds[k], stated[k] = None, None
            continue
        lo, hi = float(min(vals)), float(max(vals))
        bounds[k] = [round(lo, 6), round(hi, 6)]
        stated[k] = round(max(hi - c, c - lo) / abs(c), 4) if c else None
    return {"bounds": bounds, "stated": stated}


def outside_interval(observed: Mapping[str, Any], bounds: Mapping[str, Any]) -> list[str]:
    """The figures whose observed value lies outside the baseline's interval: the model's
    stated error on them does not hold (they are marked)."""
    out = []
    for k in FIGURES:
        b, o = bounds.get(k), observed.get(k)
        if b is None or o is None:
            continue
        lo, hi = b
        if k == "preemptions":          # counts: one either way is no miss
            lo, hi = lo - 1, hi + 1
        if not (lo - 1e-9 <= float(o) <= hi + 1e-9):
            out.append(k)
    return out


__all__ = ["SEEDS", "interval", "interval_runs", "outside_interval", "shape_error"]
