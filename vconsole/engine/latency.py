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

Who does what. The busy loop only records: the scheduler appends each observation (value,
priority, time) to a `LatencyLog` — two series per sampled token, 256+ per step, so no numpy
and no histogram there — and the telemetry feed drains it once a second (and when the engine
goes idle) as one `LatencyBatch`. The publisher folds the batches into a `LatencyStats` (in its
own process: `vconsole.engine.publish.inbox.Inbox.take`) — buckets, sums and windows in bulk
with numpy, then the percentiles — as vLLM's front end aggregates its engine core's stats. The
published figures are those of observing one value at a time: the same bucket counts, the same
sums (added in observation order, `numpy.add.accumulate` is sequential), the same windows below
``MAX_WINDOW_SAMPLES``; beyond it, still a uniform sample of the second. A restarted publisher
process starts its histograms over (a counter reset, as a restarted exporter's; the finish
counts are the engine's and carry on).
"""

from __future__ import annotations

import bisect
import math
import random
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (the first np.percentile imports it: 0.2 s, here, not in a step)

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
MAX_PENDING = 1 << 16   # observations buffered per series before they are applied


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

    def observe_many(self, values: np.ndarray) -> None:
        """``observe`` each value in order (one vectorised pass; same counts and sum)."""
        if not values.size:
            return
        idx = np.searchsorted(np.asarray(self.bounds), values, side="left")  # = bisect_left
        add = np.bincount(idx, minlength=len(self.buckets)).tolist()
        self.buckets = [a + b for a, b in zip(self.buckets, add, strict=True)]
        self.count += int(values.size)
        self.sum = float(np.add.accumulate(np.concatenate(([self.sum], values)))[-1])

    def to_dict(self) -> dict[str, Any]:
        cumulative = list(np.cumsum(self.buckets).tolist())
        return {"bounds": [*self.bounds, math.inf], "counts": cumulative, "count": self.count,
                "sum": self.sum}


class SlidingWindow:
    """Observations of the last ``window_s`` seconds, in one-second bins.

    A bin is ``[second, chunks, count]``: its values as a list of float64 arrays (one per bulk
    observation; merged into one when a full window replaces samples in place), so that
    reading the window is one concatenation and one percentile call, not a Python pass over
    every value. Every chunk is the window's own array (a copy), never a view of the caller's.
    """

    __slots__ = ("window_s", "_bins", "_size", "_rng")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._bins: deque[list[Any]] = deque()
        self._size = 0
        self._rng = random.Random(0)

    def _bin(self, second: int) -> list[Any]:
        if not self._bins or self._bins[-1][0] != second:
            self._bins.append([second, [], 0])
        return self._bins[-1]

    @staticmethod
    def _merged(b: list[Any]) -> np.ndarray:
        """The bin's values as one array (its chunks merged into one, in order)."""
        if len(b[1]) != 1:
            b[1] = [np.concatenate(b[1]) if b[1] else np.empty(0)]
        return b[1][0]

    def observe(self, now: float, value: float) -> None:
        b = self._bin(int(now))
        if self._size < MAX_WINDOW_SAMPLES:
            b[1].append(np.array([value], dtype=np.float64))
            b[2] += 1
            self._size += 1
        else:  # full: replace a random sample of this second (keeps recent data, bounded)
            i = self._rng.randrange(b[2] + 1)
            if i < b[2]:
                self._merged(b)[i] = value

    def observe_many(self, nows: np.ndarray, values: np.ndarray) -> None:
        """``observe`` each (now, value) pair in order, a run of equal seconds at a time."""
        if not values.size:
            return
        seconds = nows.astype(np.int64)
        cuts = [0, *(np.flatnonzero(np.diff(seconds)) + 1).tolist(), int(values.size)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            self._add_run(int(seconds[a]), values[a:b])

    def _add_run(self, second: int, run: np.ndarray) -> None:
        room = max(0, MAX_WINDOW_SAMPLES - self._size)
        if not room and (not self._bins or self._bins[-1][0] != second):
            return       # full, and no sample of this second to replace: no empty bin either
        b = self._bin(second)
        take = run[:room]
        if take.size:
            b[1].append(np.array(take, dtype=np.float64))
            b[2] += int(take.size)
            self._size += int(take.size)
        rest = run[room:]
        if rest.size and b[2]:  # full: each replaces a random sample of this second
            n = b[2]
            idx = np.random.default_rng(self._rng.getrandbits(64)).integers(0, n + 1, rest.size)
            keep = idx < n
            self._merged(b)[idx[keep]] = rest[keep]

    def _prune(self, now: float) -> None:
        oldest = now - self.window_s
        while self._bins and self._bins[0][0] + 1 <= oldest:
            self._size -= self._bins.popleft()[2]

    def values(self, now: float) -> np.ndarray:
        self._prune(now)
        chunks = [c for b in self._bins for c in b[1]]
        return np.concatenate(chunks) if chunks else np.empty(0)

    def percentiles(self, now: float) -> dict[str, float | int | None]:
        arr = self.values(now)
        out: dict[str, float | int | None] = {"count": int(arr.size)}
        qs = np.percentile(arr, QUANTILES).tolist() if arr.size else [None] * len(QUANTILES)
        for q, v in zip(QUANTILES, qs, strict=True):
            out[f"p{q}"] = v
        return out


class _Series:
    __slots__ = ("hist", "window")

    def __init__(self, bounds: tuple[float, ...], window_s: float) -> None:
        self.hist = Histogram(bounds)
        self.window = SlidingWindow(window_s)

    def add(self, values: np.ndarray, nows: np.ndarray) -> None:
        self.hist.observe_many(values)
        self.window.observe_many(nows, values)


class _Pending:
    """Observations of one series not yet handed over, in order: the values and their classes,
    and when they were observed as runs (``times[i]`` for ``counts[i]`` observations: a step's
    tokens share one). Unboxed arrays (`array.array`), filled while the values are fresh: the
    hand-off is then a copy of their bytes, not a walk over thousands of cold float objects."""

    __slots__ = ("values", "priorities", "times", "counts")

    def __init__(self) -> None:
        self.values = array("d")
        self.priorities = array("q")
        self.times = array("d")
        self.counts = array("q")

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, priorities, when each was observed) as float64 / int64 / float64."""
        return (np.frombuffer(self.values, np.float64), np.frombuffer(self.priorities, np.int64),
                np.repeat(np.frombuffer(self.times, np.float64),
                          np.frombuffer(self.counts, np.int64)))


@dataclass
class LatencyBatch:
    """Observations recorded since the last batch, per series (`_Pending`: the busy loop's own
    lists, handed over as they are — converting them to arrays is the publisher's work), the
    finish reasons counted since start, and the recorder's clock and window when it was taken.
    What the busy loop hands its publisher (`LatencyLog.drain`); `LatencyStats.add` folds it."""

    series: dict[str, _Pending]
    finished: dict[str, int]
    now: float
    window_s: float
    overflow: LatencyStats | None = None    # older ones, folded (`LatencyLog`)


class LatencyLog:
    """The engine's side: observations are appended (O(1) per call, no numpy) until `drain`
    takes them as one `LatencyBatch`. Histograms, windows and percentiles are the publisher's
    (`LatencyStats`, on its own thread or process): the busy loop only records.

    Bounded: a series with `MAX_PENDING` observations nobody drained (an engine without a
    publisher: the offline `LLM`, a bench) is folded into a `LatencyStats` here
    (``overflow``), which the next batch carries for the publisher to merge."""

    def __init__(self) -> None:
        self._pending = {name: _Pending() for name in SERIES}
        self._overflow: LatencyStats | None = None
        self.finished: dict[str, int] = {}   # finish reason -> requests

    def observe(self, name: str, value: float, priority: int, now: float,
                times: int = 1) -> None:
        """Record ``value`` for series ``name`` (``times`` identical observations)."""
        p = self._pending[name]
        p.values.extend([value] * times)
        p.priorities.extend([priority] * times)
        p.times.append(now)
        p.counts.append(times)
        if len(p.values) >= MAX_PENDING:
            self._fold(name)

    def observe_many(self, name: str, values: list[float], priorities: list[int],
                     now: float) -> None:
        """Record ``values[i]`` (of class ``priorities[i]``) for series ``name``, all at ``now``:
        one step's tokens in one call."""
        p = self._pending[name]
        p.values.extend(values)
        p.priorities.extend(priorities)
        p.times.append(now)
        p.counts.append(len(values))
        if len(p.values) >= MAX_PENDING:
            self._fold(name)

    def finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def _fold(self, name: str) -> None:
        if self._overflow is None:
            self._overflow = LatencyStats(math.inf)   # never read here: no pruning
        pending, self._pending[name] = self._pending[name], _Pending()
        self._overflow._apply(name, *pending.arrays())

    def drain(self, now: float, window_s: float) -> LatencyBatch:
        """Everything recorded since the last drain, taken out (the lists themselves: O(1))."""
        series = {}
        for name, pending in self._pending.items():
            if pending.values:
                series[name] = pending
                self._pending[name] = _Pending()
        batch = LatencyBatch(series, dict(self.finished), now, window_s, self._overflow)
        self._overflow = None
        return batch


class LatencyStats:
    """Every latency series, overall and per priority class: the publisher's aggregate of the
    engine's `LatencyBatch` es (`add`). `observe` / `observe_many` / `finish` record here
    directly (a `LatencyLog` of its own, folded in at `snapshot`: tests, synthetic streams)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._overall = self._new_group()
        self._by_priority: dict[int, dict[str, _Series]] = {}
        self._log = LatencyLog()
        self._recorded = False               # observed or finished here (not by `add`)
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
        self._recorded = True
        self._log.observe(name, value, priority, now, times)

    def observe_many(self, name: str, values: list[float], priorities: list[int],
                     now: float) -> None:
        self._recorded = True
        self._log.observe_many(name, values, priorities, now)

    def add(self, batch: LatencyBatch) -> LatencyStats:
        """Fold a batch in: its observations into the histograms and windows, its window and
        finish counts taken as they stood when it was drained."""
        if batch.window_s != self.window_s:
            self.set_window(batch.window_s)
        if batch.overflow is not None:
            self.merge(batch.overflow)
        for name, pending in batch.series.items():
            self._apply(name, *pending.arrays())
        self.finished = dict(batch.finished)
        return self

    def merge(self, other: LatencyStats) -> None:
        """Fold in what ``other`` holds (observed after what this one holds): histogram counts
        and sums added, its window samples added as observed (within the sample bound)."""
        groups: list[tuple[dict[str, _Series], dict[str, _Series]]] = [
            (self._overall, other._overall)]
        for prio, group in other._by_priority.items():
            if prio not in self._by_priority:
                self._by_priority[prio] = self._new_group()
            groups.append((self._by_priority[prio], group))
        for mine, group in groups:
            for name, series in group.items():
                hist, into = series.hist, mine[name].hist
                into.buckets = [a + b for a, b in zip(into.buckets, hist.buckets, strict=True)]
                into.count += hist.count
                into.sum += hist.sum
                for second, chunks, _ in series.window._bins:
                    if chunks:
                        mine[name].window._add_run(second, np.concatenate(chunks))

    def _apply(self, name: str, values: np.ndarray, prios: np.ndarray,
               nows: np.ndarray) -> None:
        """Fold observations of series ``name`` into its histograms and windows."""
        if not values.size:
            return
        values = np.maximum(values, 0.0)
        self._overall[name].add(values, nows)
        classes = np.unique(prios).tolist()
        for prio in classes:
            group = self._by_priority.get(prio)
            if group is None:
                group = self._by_priority[prio] = self._new_group()
            if len(classes) == 1:
                group[name].add(values, nows)
            else:
                mask = prios == prio
                group[name].add(values[mask], nows[mask])

    def finish(self, reason: str) -> None:
        self._recorded = True
        self._log.finish(reason)

    def snapshot(self, now: float) -> dict[str, Any]:
        """The ``latency`` topic payload: histograms and window percentiles, overall and by
        priority (keys are the priority values as strings)."""
        if self._recorded:          # what was recorded here, not added
            self.add(self._log.drain(now, self.window_s))

        def group(g: dict[str, _Series]) -> dict[str, Any]:
            return {"histograms": {n: s.hist.to_dict() for n, s in g.items()},
                    "window": {n: s.window.percentiles(now) for n, s in g.items()}}

        return {"window_s": self.window_s, "overall": group(self._overall),
                "priority": {str(p): group(g) for p, g in sorted(self._by_priority.items())},
                "finished": dict(self.finished)}
