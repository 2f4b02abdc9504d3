"""What the console knows of one engine (or one data-parallel rank): `EngineState` — the latest
payload per topic, the sparkline rings (`Series`), its trends, heartbeat age and status, sequence
gaps and restarts — and the plain records the console keeps beside it (`Alert`, `ConfigView`).

Filled by `vconsole.console.state.ConsoleState.ingest` under the state's lock; read by the
screens. Nothing here knows about other engines: a fleet is many of these, keyed by
``engine/rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vconsole.console.advisor import Advisor
from vconsole.console.trend_history import TrendHistory, path_getter
from vconsole.telemetry.schema import SchemaError, TelemetryMessage

# An engine is down after this many heartbeat intervals without a heartbeat.
STALE_INTERVALS = 3.0
DEFAULT_HEARTBEAT_S = 1.0
SERIES_CAPACITY = 4096


class Series:
    """A fixed-size ring of (time, value) samples, for sparklines over the last minutes.

    Storage is two preallocated numpy arrays, so appending at any message rate allocates nothing;
    `resample` turns the tail into one value per sparkline cell.
    """

    __slots__ = ("_t", "_v", "_n", "_i")

    def __init__(self, capacity: int = SERIES_CAPACITY) -> None:
        self._t = np.zeros(capacity, dtype=np.float64)
        self._v = np.zeros(capacity, dtype=np.float64)
        self._n = 0
        self._i = 0

    def __len__(self) -> int:
        return self._n

    def append(self, t: float, value: float) -> None:
        self._t[self._i] = t
        self._v[self._i] = value
        self._i = (self._i + 1) % len(self._t)
        self._n = min(self._n + 1, len(self._t))

    def clear(self) -> None:
        self._n = self._i = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, values), oldest first (copies)."""
        if self._n < len(self._t):
            return self._t[: self._n].copy(), self._v[: self._n].copy()
        order = np.r_[self._i: len(self._t), 0: self._i]
        return self._t[order], self._v[order]

    @property
    def last(self) -> float | None:
        return None if not self._n else float(self._v[(self._i - 1) % len(self._v)])

    def resample(self, now: float, window_s: float, n: int) -> list[float | None]:
        """``n`` buckets covering ``[now - window_s, now]``: the mean of each bucket's samples,
        the previous bucket's value where a bucket has none, None before the first sample."""
        if n <= 0:
            return []
        t, v = self.arrays()
        out: list[float | None] = [None] * n
        if not len(t):
            return out
        start = now - window_s
        idx = np.floor((t - start) / window_s * n).astype(np.int64)
        keep = (idx >= 0) & (idx < n)
        prior = v[idx < 0]
        sums = np.bincount(idx[keep], weights=v[keep], minlength=n)
        counts = np.bincount(idx[keep], minlength=n)
        last: float | None = float(prior[-1]) if len(prior) else None
        for i in range(n):
            if counts[i]:
                last = float(sums[i] / counts[i])
            out[i] = last
        return out


@dataclass
class Alert:
    recv_ts: float
    engine: str
    rank: int
    name: str
    level: str
    value: Any
    threshold: Any
    message: str


@dataclass
class ConfigView:
    """The engine's effective config as the console last heard it (control reply or the
    ``config`` topic, whichever is newer)."""

    values: dict[str, Any]
    schema: list[dict[str, Any]]
    version: int
    recv_ts: float
    origin: str  # "control" or "telemetry"

    def row(self, key: str) -> dict[str, Any] | None:
        for r in self.schema:
            if r.get("key") == key:
                return r
        return None


# Series fed from each topic: name -> (topic, getter).
SERIES: dict[str, tuple[str, Callable[[dict[str, Any]], float | None]]] = {
    "waiting": ("sched", path_getter("num_waiting")),
    "running": ("sched", path_getter("num_running")),
    "preempted": ("sched", path_getter("num_preempted")),
    "steps_per_s": ("step", path_getter("steps_per_s")),
    "tokens_per_s": ("step", path_getter("tokens_per_s")),
    "sched_share": ("step", path_getter("sched_share")),
    "step_p50_s": ("step", path_getter("step_time_p50_s")),
    "kv_usage": ("kv", path_getter("usage")),
    "token_usage": ("kv", path_getter("token_usage")),
    "fragmentation": ("kv", path_getter("fragmentation")),
    "prefix_hit_rate": ("kv", path_getter("prefix_hit_rate")),
    "proc_cpu": ("host", path_getter("proc_cpu_percent")),
    "sys_cpu": ("host", path_getter("sys_cpu_percent")),
    # The ``latency`` topic: window p99s over every priority class (the Overview's sparklines).
    "ttft_p99": ("latency", path_getter("overall", "window", "ttft_s", "p99")),
    "itl_p99": ("latency", path_getter("overall", "window", "itl_s", "p99")),
    "e2e_p99": ("latency", path_getter("overall", "window", "e2e_s", "p99")),
    "queue_p99": ("latency", path_getter("overall", "window", "queue_s", "p99")),
}


class EngineState:
    """Everything heard from one engine rank."""

    def __init__(self, engine: str, rank: int) -> None:
        self.engine = engine
        self.rank = rank
        self.latest: dict[str, dict[str, Any]] = {}
        self.recv_ts: dict[str, float] = {}
        self.block_states: np.ndarray | None = None
        # --kv-cache-metrics: seconds since each block was last allocated or hit (NaN never).
        self.block_age_s: np.ndarray | None = None
        self.block_age_lag = 0.0    # seconds between taking the ages and sending them
        self.series: dict[str, Series] = {name: Series() for name in SERIES}
        self.gpu_series: dict[int, tuple[Series, Series]] = {}
        self.advisor = Advisor()   # tuning advice from this engine's stream (Advice screen)
        self.trends = TrendHistory()   # the Trends screen: 15 minutes, one point per second
        self.last_seq: dict[str, int] = {}
        self.received = 0
        self.dropped = 0
        self.skipped = 0           # snapshots the reader conflated away (`note_skipped`)
        self.restarts = 0
        self.process: tuple[Any, Any] | None = None   # (pid, started_ts) of the last health
        self.first_seen: float | None = None
        self.last_heartbeat: float | None = None
        self.was_down = False
        self.reconnects = 0
        self.restarts_listed = 0   # engine restarts already in the alert list (by count)
        self.state_since: float | None = None     # when its health state became the current one
        self.process_since: float | None = None   # when the process now speaking was first heard

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.rank}"

    @property
    def label(self) -> str:
        return self.engine if self.rank == 0 else f"{self.engine} r{self.rank}"

    @property
    def heartbeat_interval(self) -> float:
        v = self.latest.get("health", {}).get("interval_s")
        return float(v) if isinstance(v, int | float) and v > 0 else DEFAULT_HEARTBEAT_S

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, now - self.last_heartbeat)

    def is_stale(self, now: float) -> bool:
        """No heartbeat for STALE_INTERVALS intervals (counting from first contact if none yet)."""
        ref = self.last_heartbeat if self.last_heartbeat is not None else self.first_seen
        return ref is not None and now - ref > STALE_INTERVALS * self.heartbeat_interval

    def status(self, now: float) -> str:
        """"connecting" (heard nothing yet), "down" (stale) or the engine's own health state."""
        if self.is_stale(now):
            return "down"
        if "health" not in self.latest:
            return "connecting"
        return str(self.latest["health"].get("state", "running"))

    def down_since(self, now: float) -> float | None:
        """When this engine stopped serving, by receive time: the last heartbeat of one gone
        silent ("down"), the first ``restarting`` of one restarting; None while it serves."""
        status = self.status(now)
        if status == "down":
            return self.last_heartbeat if self.last_heartbeat is not None else self.first_seen
        return self.state_since if status == "restarting" else None

    def live_bodies(self) -> dict[str, dict[str, Any]]:
        """The last body per topic of the process now speaking: after a restart, what the
        previous process sent last is left out until the new one sends its own."""
        if self.process_since is None:
            return self.latest
        return {t: b for t, b in self.latest.items()
                if self.recv_ts.get(t, self.process_since) >= self.process_since}

    def _track_seq(self, topic: str, seq: int, process: tuple[Any, Any] | None = None) -> bool:
        """Count messages lost to gaps; True when this is a new publisher process: ``seq`` went
        backwards, or (health) another process (pid, start time) speaks. The second catches
        what the first misses: a subscriber that reconnects late may first hear the new
        engine at a seq above the last one the old engine reached."""
        last = self.last_seq.get(topic)
        restarted = last is not None and seq <= last
        if process is not None:
            restarted = restarted or (self.process is not None and process != self.process)
            self.process = process
        if restarted:
            self.restarts += 1
            self.last_seq.clear()
        elif last is not None and seq > last + 1:
            self.dropped += seq - last - 1
        self.last_seq[topic] = seq
        if restarted:
            self.advisor.reset()     # a new engine process: its evidence starts afresh
        return restarted

    def apply(self, msg: TelemetryMessage, recv_ts: float) -> bool:
        """Fold one message in; True when it shows the engine restarted."""
        p = msg.payload
        if self.first_seen is None:
            self.first_seen = recv_ts
        restarted = self._track_seq(msg.topic, msg.seq, (p.get("pid"), p.get("started_ts"))
                                    if msg.topic == "health" else None)
        if restarted:
            self.process_since = recv_ts
        if msg.topic == "health" and p.get("state") != self.latest.get("health", {}).get("state"):
            self.state_since = recv_ts
        self.received += 1
        self.latest[msg.topic] = p
        self.recv_ts[msg.topic] = recv_ts
        self.advisor.observe(msg)
        if msg.topic == "health":
            self.last_heartbeat = recv_ts
        elif msg.topic == "kv":
            try:
                self.block_states = msg.block_states()
            except SchemaError:
                self.block_states = None
            try:
                self.block_age_s = msg.array("block_age_s") if "block_age_s" in p else None
                taken = p.get("block_age_ts")
                self.block_age_lag = max(0.0, float(p["ts"]) - taken) \
                    if isinstance(taken, int | float) and taken > 0 else 0.0
            except SchemaError:
                self.block_age_s = None
        elif msg.topic == "gpu":
            for d in p.get("devices") or ():
                idx = int(d.get("index", 0))
                util, mem = self.gpu_series.setdefault(idx, (Series(), Series()))
                if isinstance(d.get("util"), int | float):
                    util.append(recv_ts, float(d["util"]))
                total = d.get("mem_total") or 0
                if total:
                    mem.append(recv_ts, float(d.get("mem_used", 0)) / float(total))
        for name, (topic, get) in SERIES.items():
            if topic == msg.topic:
                value = get(p)
                if value is not None:
                    self.series[name].append(recv_ts, value)
        self.trends.add(msg.topic, p, recv_ts)
        return restarted
