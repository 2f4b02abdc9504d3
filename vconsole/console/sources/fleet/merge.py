"""Merged percentiles: the fleet's TTFT / ITL over a window, from bucket counts summed across
engines (vllm-htop's rule), never an average of the engines' percentiles.

A histogram here is the telemetry's wire form: ``{"bounds": [... +Inf], "counts": cumulative,
"count", "sum"}``. Engines of different kinds use different bounds (SGLang's TTFT buckets are
not vLLM's), so the merged histogram keeps only the bounds **every** engine has (+Inf always):
at those, each engine's cumulative count is exact, and so is their sum. Coarser buckets make a
percentile known only as a range, and it is shown as one (`Percentile.bound`), as
`vconsole.console.sources.vllm_metrics.quantile_bound` decides for one engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vconsole.console.sources.vllm_metrics import quantile, quantile_bound

Hist = dict[str, Any]


@dataclass(frozen=True)
class Percentile:
    value: float | None
    bound: tuple[float, float | None] | None = None    # (lo, hi); hi None: above lo

    @property
    def known(self) -> bool:
        return self.value is not None


NONE = Percentile(None)


def _bounds(h: Hist) -> list[float]:
    return [math.inf if (b == "+Inf" or b == math.inf) else float(b) for b in h["bounds"]]


def window(now: Hist, then: Hist | None) -> Hist:
    """The observations between ``then`` and ``now`` (cumulative): their difference, or all of
    ``now`` when there is no ``then``, the bounds changed or a count went down (a restart: the
    counts started over, and a negative count is never made)."""
    if then is None or _bounds(then) != _bounds(now) or then["count"] > now["count"] \
            or any(b > a for a, b in zip(now["counts"], then["counts"], strict=True)):
        return now
    return {"bounds": now["bounds"],
            "counts": [a - b for a, b in zip(now["counts"], then["counts"], strict=True)],
            "count": now["count"] - then["count"], "sum": now["sum"] - then["sum"]}


def merge(hists: Sequence[Hist]) -> tuple[list[float], list[float]]:
    """(bounds, summed cumulative counts) over the bounds all ``hists`` share."""
    if not hists:
        return [], []
    tables = [dict(zip(_bounds(h), h["counts"], strict=True)) for h in hists]
    common = sorted(set.intersection(*(set(t) for t in tables)) | {math.inf})
    counts = [sum(_at(t, b, h) for t, h in zip(tables, hists, strict=True)) for b in common]
    return common, counts


def _at(table: dict[float, float], bound: float, h: Hist) -> float:
    return float(table[bound]) if bound in table else float(h["count"])   # +Inf: all of it


def percentile(q: float, bounds: list[float], counts: list[float]) -> Percentile:
    """The ``q`` quantile of cumulative ``counts`` (None with no observations); its bounds
    when it falls in the first, the open or a wide bucket."""
    value = quantile(q, bounds, counts)
    if value is None:
        return NONE
    b = quantile_bound(q, bounds, counts)
    return Percentile(value, (float(b["lo"] or 0.0), b["hi"]) if b is not None else None)


def merged_percentile(q: float, hists: Sequence[Hist]) -> Percentile:
    bounds, counts = merge(hists)
    return percentile(q, bounds, counts) if bounds else NONE
