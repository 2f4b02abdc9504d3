"""Request latency on the engine's own clock: cumulative histograms and sliding-window percentiles.

What is measured, per request, with the scheduler's clock (vLLM's definitions, so dashboards
built for ``vllm:*`` read the same):

- ``ttft_s``      first token - arrival (time to first token)
- ``itl_s``       gap between two consecutive output tokens (inter-token latency; a step that
                  delivers several tokens counts its gap divided by them, once per token)
- ``e2e_s``       finish - arrival
- ``queue_s``     first scheduled - arrival
- ``prefill_s``   first token - first scheduled
- ``decode_s``    last token - first token
- ``inference_s`` last token - first scheduled

Each series is kept twice: a cumulative `Histogram` with vLLM's fixed bucket bounds (never reset,
so a scraper can take rates) and a `SlidingWindow` of recent observations for p50/p90/p99 over
``window_s``. Both overall and per priority class. `LatencyStats.snapshot` returns plain data
(the ``latency`` telemetry topic's payload).

Invariants: a histogram's ``count`` equals the number of observations ever made and its bucket
counts are cumulative (``counts[i]`` = observations <= ``bounds[i]``, the last bound is +Inf);
a window holds only observations younger than ``window_s`` and at most ``MAX_WINDOW_SAMPLES`` per
series (beyond that it keeps a uniform sample), so memory is bounded at any token rate.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from typing import Any

import numpy as np

# Bucket bounds as in vLLM (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
SERIES: dict[str, tuple[float, ...]] = {
    "ttft_s": TTFT_BUCKETS,
    "itl_s": ITL_BUCKETS,
    "e2e_s": REQUEST_LATENCY_BUCKETS,
    "queue_s": REQUEST_LATENCY_BUCKETS,
    "prefill_s": REQUEST_LATENCY_BUCKETS,
    "decode_s": REQUEST_LATENCY_BUCKETS,
    "inference_s": REQUEST_LATENCY_BUCKETS,
}
QUANTILES = (50, 90, 99)
MAX_WINDOW_SAMPLES = 20_000


class Histogram:
    """Cumulative counts over fixed upper bounds (the last one +Inf), as Prometheus keeps them."""

    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)   # per bucket, not cumulative (cheap observe)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        cumulative = list(np.cumsum(self.buckets).tolist())
        return {"bounds": [*self.bounds, math.inf], "counts": cumulative, "count": self.count,
                "sum": self.sum}


class SlidingWindow:
    """Observations of the last ``window_s`` seconds, in one-second bins."""

    __slots__ = ("window_s", "_bins", "_size", "_rng")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._bins: deque[tuple[int, list[float]]] = deque()
        self._size = 0
        self._rng = random.Random(0)

    def observe(self, now: float, value: float) -> None:
        second = int(now)
        if not self._bins or self._bins[-1][0] != second:
            self._bins.append((second, []))
        values = self._bins[-1][1]
        if self._size < MAX_WINDOW_SAMPLES:
            values.append(value)
            self._size += 1
        else:  # full: replace a random sample of this second (keeps recent data, bounded)
            i = self._rng.randrange(len(values) + 1)
            if i < len(values):
                values[i] = value

    def _prune(self, now: float) -> None:
        oldest = now - self.window_s
        while self._bins and self._bins[0][0] + 1 <= oldest:
            self._size -= len(self._bins.popleft()[1])

    def values(self, now: float) -> np.ndarray:
        self._prune(now)
        if not self._bins:
            return np.empty(0)
        return np.fromiter((v for _, vs in self._bins for v in vs), dtype=np.float64,
                           count=self._size)

    def percentiles(self, now: float) -> dict[str, float | int | None]:
        arr = self.values(now)
        out: dict[str, float | int | None] = {"count": int(arr.size)}
        for q in QUANTILES:
            out[f"p{q}"] = float(np.percentile(arr, q)) if arr.size else None
        return out


class _Series:
    __slots__ = ("hist", "window")

    def __init__(self, bounds: tuple[float, ...], window_s: float) -> None:
        self.hist = Histogram(bounds)
        self.window = SlidingWindow(window_s)


class LatencyStats:
    """Every latency series, overall and per priority class. Fed by the scheduler."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._overall = self._new_group()
        self._by_priority: dict[int, dict[str, _Series]] = {}
        self.finished: dict[str, int] = {}   # finish reason -> requests

    def _new_group(self) -> dict[str, _Series]:
        return {name: _Series(bounds, self.window_s) for name, bounds in SERIES.items()}

    def set_window(self, window_s: float) -> None:
        self.window_s = window_s
        for group in (self._overall, *self._by_priority.values()):
            for series in group.values():
                series.window.window_s = window_s

    def observe(self, name: str, value: float, priority: int, now: float,
                times: int = 1) -> None:
        """Record ``value`` for series ``name`` (``times`` identical observations)."""
        value = max(0.0, value)
        group = self._by_priority.get(priority)
        if group is None:
            group = self._by_priority[priority] = self._new_group()
        for series in (self._overall[name], group[name]):
            for _ in range(times):
                series.hist.observe(value)
                series.window.observe(now, value)

    def finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def snapshot(self, now: float) -> dict[str, Any]:
        """The ``latency`` topic payload: histograms and window percentiles, overall and by
        priority (keys are the priority values as strings)."""

        def group(g: dict[str, _Series]) -> dict[str, Any]:
            return {"histograms": {n: s.hist.to_dict() for n, s in g.items()},
                    "window": {n: s.window.percentiles(now) for n, s in g.items()}}

        return {"window_s": self.window_s, "overall": group(self._overall),
                "priority": {str(p): group(g) for p, g in sorted(self._by_priority.items())},
                "finished": dict(self.finished)}
