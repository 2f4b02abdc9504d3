"""The Trends screen's history: each figure's last 15 minutes, one point per second.

`EngineState.apply` (the reader thread, under the state's lock) hands every message to its
``trends`` (`TrendHistory.add`), so a live engine and a replayed recording fill it the same way.
(Not to be confused with Steering's ``change_log``: the changes the console sent.) The sparklines'
`Series` keep every sample for a couple of minutes; a trend instead folds the samples of each
second into one point (their mean, or their maximum for a "max" figure), so 15 minutes cost 900
points per figure whatever the telemetry rate.

Invariant: a `Trend` holds at most ``capacity`` finished one-second bins plus the bin being
filled; appending never allocates (two preallocated numpy rings), and a bin is final once a
sample of a later second arrives. A sample older than the open bin (a clock step backwards) is
folded into the open bin rather than reordering the past.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

HISTORY_S = 900.0          # 15 minutes, the longest range the Trends screen shows
RESOLUTION_S = 1.0         # one point per second
MEAN, MAX = "mean", "max"


class Trend:
    """One figure's recent history, downsampled into ``resolution_s`` bins."""

    __slots__ = ("agg", "resolution_s", "_t", "_v", "_n", "_i", "_bin", "_sum", "_count",
                 "_max")

    def __init__(self, agg: str = MEAN, history_s: float = HISTORY_S,
                 resolution_s: float = RESOLUTION_S) -> None:
        capacity = int(math.ceil(history_s / resolution_s))
        self.agg = agg
        self.resolution_s = resolution_s
        self._t = np.zeros(capacity, dtype=np.float64)   # bin centre times
        self._v = np.zeros(capacity, dtype=np.float64)
        self._n = 0
        self._i = 0
        self._bin: int | None = None                      # the open bin's index (time // res)
        self._sum = 0.0
        self._count = 0
        self._max = -math.inf

    def __len__(self) -> int:
        """Points held, the open bin included."""
        return self._n + (1 if self._count else 0)

    @property
    def capacity(self) -> int:
        return len(self._t)

    def add(self, t: float, value: float) -> None:
        if not math.isfinite(value):
            return
        b = int(t // self.resolution_s)
        if self._bin is None or b > self._bin:
            self._close()
            self._bin = b
        self._sum += value
        self._count += 1
        self._max = max(self._max, value)

    def _value(self) -> float:
        return self._max if self.agg == MAX else self._sum / self._count

    def _close(self) -> None:
        if not self._count or self._bin is None:
            return
        self._t[self._i] = (self._bin + 0.5) * self.resolution_s
        self._v[self._i] = self._value()
        self._i = (self._i + 1) % len(self._t)
        self._n = min(self._n + 1, len(self._t))
        self._sum, self._count, self._max = 0.0, 0, -math.inf

    def clear(self) -> None:
        self._n = self._i = 0
        self._bin = None
        self._sum, self._count, self._max = 0.0, 0, -math.inf

    def points(self, now: float | None = None,
               window_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(bin centre times, values), oldest first, the open bin last; only the bins that end
        after ``now - window_s`` when both are given (copies)."""
        if self._n < len(self._t):
            t, v = self._t[: self._n].copy(), self._v[: self._n].copy()
        else:
            order = np.r_[self._i: len(self._t), 0: self._i]
            t, v = self._t[order], self._v[order]
        if self._count and self._bin is not None:
            t = np.append(t, (self._bin + 0.5) * self.resolution_s)
            v = np.append(v, self._value())
        if now is not None and window_s is not None:
            keep = t + self.resolution_s / 2 > now - window_s
            t, v = t[keep], v[keep]
        return t, v

    @property
    def last(self) -> float | None:
        if self._count:
            return self._value()
        return None if not self._n else float(self._v[(self._i - 1) % len(self._v)])


Getter = Callable[[dict[str, Any]], float | None]


def path_getter(*path: str) -> Getter:
    """A getter of the number at ``path`` in a payload (None when absent or not a number)."""
    def get(p: dict[str, Any]) -> float | None:
        cur: Any = p
        for k in path:
            if not isinstance(cur, dict):
                return None
            cur = cur.get(k)
        return float(cur) if isinstance(cur, int | float) and not isinstance(cur, bool) else None
    return get


def _latency(series: str, q: str) -> Getter:
    """A window percentile of the ``latency`` topic, over every priority class."""
    return path_getter("overall", "window", series, q)


# name -> (topic, getter, how a second's samples become one point)
TRENDS: dict[str, tuple[str, Getter, str]] = {
    "tokens_per_s": ("step", path_getter("tokens_per_s"), MEAN),
    "step_p50_s": ("step", path_getter("step_time_p50_s"), MEAN),
    "step_max_s": ("step", path_getter("step_time_max_s"), MAX),
    "waiting": ("sched", path_getter("num_waiting"), MEAN),
    "running": ("sched", path_getter("num_running"), MEAN),
    "kv_usage": ("kv", path_getter("usage"), MEAN),
    "fragmentation": ("kv", path_getter("fragmentation"), MEAN),
    "ttft_p50_s": ("latency", _latency("ttft_s", "p50"), MEAN),
    "ttft_p99_s": ("latency", _latency("ttft_s", "p99"), MEAN),
    "itl_p50_s": ("latency", _latency("itl_s", "p50"), MEAN),
    "itl_p99_s": ("latency", _latency("itl_s", "p99"), MEAN),
    "e2e_p99_s": ("latency", _latency("e2e_s", "p99"), MEAN),
    "queue_p99_s": ("latency", _latency("queue_s", "p99"), MEAN),
}
TOPICS = frozenset(topic for topic, _, _ in TRENDS.values())


class TrendHistory:
    """Every trend of one engine. A latency percentile that is null (an empty window) adds no
    point rather than a fake zero."""

    def __init__(self, history_s: float = HISTORY_S, resolution_s: float = RESOLUTION_S) -> None:
        self.history_s = history_s
        self.trends: dict[str, Trend] = {
            name: Trend(agg, history_s, resolution_s) for name, (_, _, agg) in TRENDS.items()}

    def __getitem__(self, name: str) -> Trend:
        return self.trends[name]

    def add(self, topic: str, payload: dict[str, Any], t: float) -> None:
        if topic not in TOPICS:
            return
        for name, (src, get, _) in TRENDS.items():
            if src == topic:
                value = get(payload)
                if value is not None:
                    self.trends[name].add(t, value)
