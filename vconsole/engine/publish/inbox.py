"""What the engine thread hands the publisher thread: the one place both threads touch.

Why a class of its own: the busy loop must only ever pay an O(1) hand-off (`record_step`
appends to a bounded deque and adds the step to the cumulative totals, `submit_snapshot`
replaces one "latest" slot), and the publisher thread must see each hand-off whole. Every slot
here is written by the engine thread and taken by the publisher thread under one lock (`take`
empties them at once into a `Handoff`); the steps go through a bounded deque the publisher
thread drains when its ``step`` window closes (`drain_window`).

Latency comes as the engine's raw observations (`vconsole.engine.latency.LatencyBatch`): they
queue here and `take` folds them into this inbox's `LatencyStats` on the publisher's side, so
the histograms, windows and percentiles never cost the busy loop.

Invariant: objects handed over belong to the publisher afterwards (the engine must not mutate
them; ``KVStats.block_states`` is sent without a copy).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.latency import LatencyBatch, LatencyStats
from vconsole.engine.publish.block_residency import ResidencyHistograms
from vconsole.engine.publish.mfu import ModelDims, PerfCounters
from vconsole.engine.publish.request_text import TokenLists
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats

MAX_BUFFERED_STEPS = 1 << 16  # steps kept between two publish windows; older ones are counted
# Tokens per engine step: the ``step`` topic's ``iteration_tokens`` histogram (vLLM's bounds for
# ``vllm:iteration_tokens_total``).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

Snapshot = tuple[SchedulerStats, KVStats, int, float]   # sched, kv, steps, wall time
# A snapshot's request text: its rows' token id lists, or (from a publisher process) decoded.
Text = list[TokenLists] | dict[str, list[str]]


class SnapshotClock:
    """When the busy loop next builds a snapshot: at most ``hz`` times a second (the in-process
    publisher's and the publisher process's feed alike). Engine thread only."""

    def __init__(self) -> None:
        self._next_due = 0.0

    def due(self, hz: float) -> bool:
        now = time.monotonic()
        if now < self._next_due:
            return False
        self._next_due = now + 1.0 / hz
        return True


@dataclass
class Handoff:
    """What the engine thread handed over since the last `Inbox.take`, all at once, and its
    step and error counts as they stood then."""

    snapshot: Snapshot | None = None
    text: Text | None = None                  # the snapshot's request text, when published
    config: EngineConfig | None = None
    latency: dict[str, Any] | None = None
    dp: dict[str, Any] | None = None
    waves: list[dict[str, Any]] = field(default_factory=list)
    announce: tuple[int, dict[str, Any]] | None = None
    state: str = "idle"
    errors: dict[str, str] = field(default_factory=dict)
    steps_recorded: int = 0
    steps_dropped: int = 0
    last_step_t: float | None = None
    engine_errors: int = 0


@dataclass
class StepWindow:
    """The steps recorded since the last window, and the cumulative fields of the ``step``
    topic (``iteration_tokens``, ``phase_s_total``) as they stood when it closed."""

    steps: list[StepStats]
    totals: dict[str, Any]


class Inbox:
    """The hand-off slots of one publisher, starting from ``config`` (announced as version 0).

    Engine thread: `record_step`, `snapshot_due`, `submit_snapshot`, `submit_latency`,
    `submit_dp`, `submit_wave`, `report_error`, `set_state`, `publish_config`, `update_config`.
    Publisher thread: `take`, `steps_pending`, `drain_window`, `wait`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config              # the latest: engine thread writes, a new loop reads
        self.announced: tuple[int, dict[str, Any]] = (0, config.to_dict())   # the latest
        self._steps: deque[StepStats] = deque(maxlen=MAX_BUFFERED_STEPS)
        self.steps_recorded = 0           # written by the engine thread only
        self._steps_seen = 0              # drained by the publisher thread (its thread only)
        self.last_step_t: float | None = None
        self._snapshots = SnapshotClock()  # engine thread only (snapshot_due)
        # Cumulative since start, every recorded step (none lost to the bounded deque): tokens
        # per step (per bucket, not cumulative) and their sum, phase ns. Guarded by _totals_lock
        # (held for a few additions or one copy), so one step is in all of them or in none.
        self._totals_lock = threading.Lock()
        self._iter_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iter_tokens = 0
        self._phase_ns = [0, 0, 0, 0]     # schedule, execute, update, structured
        # vLLM's optional metrics, cumulative (publisher thread, `drain_window`): the MFU
        # counters over drained steps (`measure_perf`), block residency (`submit_kv_residency`).
        self.perf: PerfCounters | None = None
        self.residency: ResidencyHistograms | None = None
        self._residency_pending: list[list[ResidencySample]] = []    # guarded by _lock
        self._lock = threading.Lock()     # guards the slots below
        self._latest: Snapshot | None = None
        self._text: Text | None = None
        self._latency: list[LatencyBatch] = []
        self.latency = LatencyStats(config.latency_window_s)   # publisher thread only (take)
        self._dp: dict[str, Any] | None = None
        self._waves: list[dict[str, Any]] = []
        self._engine_errors = 0           # `report_error` calls
        self._error_reports: dict[str, str] = {}    # part -> last message, not yet taken
        self._state = "idle"
        self._pending_config: EngineConfig | None = None
        self._announce: tuple[int, dict[str, Any]] | None = None
        self._wake = threading.Event()
        # The engine's own step count and last step time, read for each take (a publisher
        # process's: `publisher_process.LiveCounters`); None: this inbox's own.
        self.live: Callable[[], tuple[int, float | None]] | None = None

    # --- engine thread ----------------------------------------------------------------------

    def record_step(self, stats: StepStats, t: float | None = None) -> None:
        """O(1): buffer one step's stats for the next ``step`` window and add it to the
        cumulative totals. ``t``: when the step ended (monotonic; default now)."""
        tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        bucket = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)  # bounds are inclusive
        with self._totals_lock:
            self._iter_buckets[bucket] += 1
            self._iter_tokens += tokens
            phase = self._phase_ns
            phase[0] += stats.schedule_ns
            phase[1] += stats.execute_ns
            phase[2] += stats.update_ns
            phase[3] += stats.structured_ns
        self._steps.append(stats)
        self.steps_recorded += 1
        self.last_step_t = time.monotonic() if t is None else t

    def snapshot_due(self) -> bool:
        """True at most ``telemetry_hz`` times a second: time to build and submit a snapshot."""
        return self._snapshots.due(self.config.telemetry_hz)

    def submit_snapshot(self, sched: SchedulerStats, kv: KVStats, state: str,
                        num_steps: int, text: Text | None = None,
                        wall: float | None = None) -> None:
        """``text``: token id lists (decoded on the publisher thread), or the decoded map
        itself (a publisher process's: decoded in the engine); ``wall``: when the engine took
        the snapshot (unix seconds; default now)."""
        with self._lock:
            self._latest = (sched, kv, num_steps, time.time() if wall is None else wall)
            self._text = text
            self._state = state
        self._wake.set()

    def submit_latency(self, batch: LatencyBatch) -> None:
        """The latency observations since the last batch (folded in and published at once)."""
        with self._lock:
            self._latency.append(batch)
        self._wake.set()

    def submit_kv_residency(self, samples: list[ResidencySample]) -> None:
        """Sampled KV block evictions since the last call (folded at the next window)."""
        with self._lock:
            self._residency_pending.append(samples)
        self._wake.set()

    def measure_perf(self, dims: ModelDims) -> None:
        """Count vLLM's estimated FLOPs and bytes of every drained step from now on."""
        self.perf = PerfCounters(dims)

    def submit_dp(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._dp = body
        self._wake.set()

    def submit_wave(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._waves.append(body)
        self._wake.set()

    def report_error(self, part: str, message: str) -> None:
        with self._lock:
            self._engine_errors += 1
            self._error_reports[part] = message
        self._wake.set()

    def set_state(self, state: str) -> None:
        with self._lock:
            self._state = state

    def publish_config(self, version: int, values: dict[str, Any]) -> None:
        with self._lock:
            self._announce = self.announced = (version, dict(values))
        self._wake.set()

    def update_config(self, config: EngineConfig) -> None:
        self.config = config  # read by snapshot_due on the engine thread
        with self._lock:
            self._pending_config = config
        self._wake.set()

    def continue_count(self, steps_recorded: int, engine_errors: int = 0) -> None:
        """Count on from an earlier publisher's figures (a restarted publisher process)."""
        self.steps_recorded = self._steps_seen = steps_recorded
        self._engine_errors = engine_errors

    def count_lost(self, steps: int) -> None:
        """Steps the engine recorded that never reached this inbox (``steps_dropped``)."""
        self.steps_recorded += steps

    @property
    def engine_errors(self) -> int:
        return self._engine_errors

    # --- publisher thread --------------------------------------------------------------------

    def take(self) -> Handoff:
        """Everything the engine thread handed over since the last call, at once."""
        steps, last_step_t = self.steps_recorded, self.last_step_t
        if self.live is not None:
            live_steps, live_t = self.live()
            if live_steps >= steps:
                steps, last_step_t = live_steps, live_t
        with self._lock:
            batches, self._latency = self._latency, []
            h = Handoff(snapshot=self._latest, text=self._text, config=self._pending_config,
                        dp=self._dp, waves=self._waves,
                        announce=self._announce, state=self._state, errors=self._error_reports,
                        steps_recorded=steps, steps_dropped=self._steps_dropped(),
                        last_step_t=last_step_t, engine_errors=self._engine_errors)
            self._latest = self._pending_config = self._dp = None
            self._text = None
            self._announce = None
            self._waves, self._error_reports = [], {}
        if batches:
            h.latency = self._fold(batches, h)
        return h

    def _fold(self, batches: list[LatencyBatch], h: Handoff) -> dict[str, Any] | None:
        """The ``latency`` body after ``batches`` (publisher thread). A fold that raises costs
        the latency only: the aggregate starts over (a half-folded batch would count twice or
        not at all), and the failure is reported with the hand-off's other errors."""
        try:
            for batch in batches:
                self.latency.add(batch)
            return self.latency.snapshot(batches[-1].now)
        except Exception as e:
            self.latency = LatencyStats(self.config.latency_window_s)
            h.errors["latency"] = f"{type(e).__name__}: {e} (the histograms start over)"
            return None

    def steps_pending(self) -> bool:
        return bool(self._steps)

    def sent_all(self) -> bool:
        """Nothing handed over is still waiting for the publisher thread (steps, a snapshot,
        a latency or dp body, waves, a config announcement)."""
        with self._lock:
            return not (self._steps or self._latest or self._latency or self._dp
                        or self._waves or self._announce)

    def _steps_dropped(self) -> int:
        """Steps lost to the bounded deque before the publisher thread drained them."""
        return max(0, self.steps_recorded - self._steps_seen - len(self._steps))

    def drain_window(self) -> StepWindow:
        """The steps recorded since the last window (oldest first) and the totals now."""
        steps = []
        pop = self._steps.popleft
        with contextlib.suppress(IndexError):
            while True:
                steps.append(pop())
        self._steps_seen += len(steps)
        totals = self._step_totals()
        if self.perf is not None:
            totals["perf"] = self.perf.add(steps)
        with self._lock:
            pending, self._residency_pending = self._residency_pending, []
        if pending or self.config.kv_cache_metrics:
            if self.residency is None:
                self.residency = ResidencyHistograms()
            for samples in pending:
                self.residency.add(samples)
            totals["kv_residency"] = self.residency.body()
        return StepWindow(steps, totals)

    def _step_totals(self) -> dict[str, Any]:
        """``iteration_tokens`` (a histogram as the ``latency`` topic's: bounds with +Inf,
        cumulative counts, count, sum) and ``phase_s_total``."""
        with self._totals_lock:
            buckets = self._iter_buckets.copy()
            tokens = self._iter_tokens
            schedule, execute, update, structured = self._phase_ns
        counts = list(itertools.accumulate(buckets))
        return {
            "iteration_tokens": {"bounds": [*ITERATION_TOKENS_BUCKETS, math.inf],
                                 "counts": counts, "count": counts[-1], "sum": tokens},
            "phase_s_total": {"schedule": schedule / 1e9, "execute": execute / 1e9,
                              "update": update / 1e9, "structured": structured / 1e9},
        }

    def wake(self) -> None:
        self._wake.set()

    def wait(self, seconds: float) -> None:
        """Until ``seconds`` pass or the engine thread hands something over."""
        self._wake.wait(seconds)
        self._wake.clear()
