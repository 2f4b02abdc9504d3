"""The busy loop's telemetry feed: what the publisher gets between two steps.

At most ``telemetry_hz`` times a second (the publisher says when, `snapshot_due`) the loop
hands it the scheduler and KV snapshot, a data-parallel rank's ``dp`` figures, and at most once
a second — or whenever the engine goes idle, as the last snapshot before the loop blocks — the
latency observations recorded since (the publisher computes the percentiles) and, with
``kv_cache_metrics``, the sampled KV block evictions; with ``publish_request_text`` on, the
token id lists of the rows whose request text goes out (`request_ids_for_text`). Each part runs behind the core's
`vconsole.engine.telemetry_guard`: one that raises is logged, counted and rebuilt, and is
missing from this snapshot only. Used by the busy loop's thread only.

What the busy loop pays here is the whole of telemetry's cost to it (`vconsole bench
telemetry`'s ``busy_loop_feed_share``): the publisher runs in its own process
(`vconsole.engine.publish.publisher_process`), so a hand-off is a pack and a non-blocking send
(the waiting rows as what changed in the queue: `vconsole.engine.publish.queue_mirror`), and nothing of the publisher's competes with the loop for the GIL. With
request text on, its new or grown rows are decoded here too (the publisher process has no
tokenizer): the opt-in's cost, one decode per running row per snapshot.

The request table is made by the publishing side's `RequestRows` (``rows``, one per feed: a log
of the waiting queue, attached at the first snapshot, and the table's caches); when the
``sched`` part fails they are dropped and the next snapshot reads the queue afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vconsole.engine.publish.request_rows import QueueRows, RequestRows
from vconsole.shared.stats import RequestTable, SchedulerStats
from vconsole.telemetry.request_text import TEXT_ROWS

if TYPE_CHECKING:
    from vconsole.engine.process.serving_core import ServingCore
    from vconsole.engine.publish.publisher import TelemetryPublisher

LATENCY_INTERVAL_S = 1.0  # latency percentiles are computed at most this often


class TelemetryFeed:
    """``dirty``: the state changed since the last snapshot (an idle loop wakes once more to
    send it instead of blocking on a stale one)."""

    def __init__(self, core: ServingCore, publisher: TelemetryPublisher,
                 dp_body: Callable[[], dict[str, Any] | None]) -> None:
        self.core = core
        self.guard = core.telemetry_guard
        self.publisher = publisher
        self._dp_body = dp_body
        self.rows = RequestRows(mirrored=publisher.mirrors_queue)
        self.dirty = True
        self._next_latency = 0.0    # when the next latency snapshot is due
        # vLLM's --kv-cache-metrics: the pool samples block lifetimes, handed over with latency.
        self._residency = core.config.kv_cache_metrics
        if self._residency:
            core.enable_kv_residency(core.config.kv_cache_metrics_sample)

    def maybe_snapshot(self, state: str) -> None:
        """The snapshot, if one is due."""
        if not self.publisher.snapshot_due():
            return
        # A snapshot a guarded part failed leaves the engine dirty.
        self.dirty = not self.submit_snapshot(state)
        core, run = self.core, self.guard.run
        dp_body = run("dp", self._dp_body)
        if dp_body is not None:
            self.publisher.submit_dp(dp_body)
        now = time.monotonic()
        # Idle: this is the last snapshot before the loop blocks, so latency goes too.
        if now >= self._next_latency or not core.has_unfinished_requests():
            batch = run("latency", core.latency_batch)
            if batch is not None:
                self.publisher.submit_latency(batch)
            if self._residency:
                samples = run("kv_residency", core.take_kv_residency)
                if samples:
                    self.publisher.submit_kv_residency(samples)
            self._next_latency = now + LATENCY_INTERVAL_S

    def postpone(self, seconds: float) -> None:
        """Move the latency cadence ``seconds`` later: time the feed was not fed does not
        count (`vconsole bench telemetry` pauses it between rounds)."""
        self._next_latency += seconds

    def submit_snapshot(self, state: str) -> bool:
        """Send the scheduler and KV snapshot; False when a guarded part failed."""
        core, run = self.core, self.guard.run
        max_rows = core.config.telemetry_max_requests
        sched = run("sched", core.scheduler_stats, max_rows, self.rows)
        if sched is None:
            run("sched", self.rows.reset)
        kv = run("kv", core.kv_stats)
        if sched is None or kv is None:
            return False
        text = None
        if self.publisher.wants_text():
            text = run("request_text", core.token_lists, request_ids_for_text(sched, max_rows))
        self.publisher.submit_snapshot(sched, kv, state, core.num_steps, text)
        return True


def request_ids_for_text(sched: SchedulerStats, max_rows: int) -> list[str]:
    """The ids of the rows that carry request text: the first `TEXT_ROWS` the ``sched``
    message sends (running first, then the head of the waiting queue; with the waiting rows
    left to a publisher process, the queue's head now)."""
    n = min(TEXT_ROWS, max_rows)
    rows = sched.requests
    if isinstance(rows, RequestTable):
        if isinstance(rows.parts, QueueRows):
            return rows.parts.first_ids(n)
        return list(rows.columns["id"][:n])
    return [r.id for r in rows[:n]]
