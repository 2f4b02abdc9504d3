"""``log_stats``: the engine's periodic stats line, like vLLM's ``--log-stats``."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("vconsole.engine")


class StatsLog:
    """``log_stats``: one line to the engine's log (stderr) every ``log_stats_interval_s`` —
    steps/s, prompt and generation tok/s, queue lengths, KV and token usage, prefix hit rate,
    each over the interval. Written while steps run and once more after the engine drained, then
    nothing until work comes back. Busy loop only; the toggle and the interval are read from the
    config at every call (both hot)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._steps = self._prompt_tokens = self._generation_tokens = 0
        self._quiet = True              # the last line (or none yet) showed no steps
        self._prefix: tuple[int, int] | None = None  # (queries, hits) at the last line

    def record(self, step: Any) -> None:
        if self._steps == 0 and self._quiet:    # the interval starts with the first step
            self._t0 = time.monotonic() - step.total_ns / 1e9
        self._steps += 1
        self._prompt_tokens += step.num_prefill_tokens
        self._generation_tokens += step.num_decode_tokens

    def wait_s(self, config: Any) -> float | None:
        """Seconds until a line is due; None when none will be (off, or nothing to report)."""
        if not config.log_stats or (self._steps == 0 and self._quiet):
            return None
        return max(0.0, self._t0 + config.log_stats_interval_s - time.monotonic())

    def maybe_log(self, core: Any) -> None:
        enabled = bool(core.config.log_stats)
        wait = self.wait_s(core.config)
        if not enabled:
            self._steps = self._prompt_tokens = self._generation_tokens = 0
            self._quiet, self._prefix = True, None
        if wait is None or wait > 0:
            return
        now = time.monotonic()
        elapsed = max(now - self._t0, 1e-9)
        sched, kv = core.scheduler_stats(0), core.kv_stats()
        queries, hits = kv.prefix_queries, kv.prefix_hits
        if self._prefix is not None:
            queries, hits = queries - self._prefix[0], hits - self._prefix[1]
        self._prefix = (kv.prefix_queries, kv.prefix_hits)
        log.info("stats: %.1f steps/s, prompt %.1f tok/s, generation %.1f tok/s, running %d, "
                 "waiting %d, preempted %d, KV usage %.1f%% (tokens %.1f%%), "
                 "prefix hit rate %.1f%%", self._steps / elapsed, self._prompt_tokens / elapsed,
                 self._generation_tokens / elapsed, sched.num_running, sched.num_waiting,
                 sched.num_preempted, 100 * kv.usage, 100 * kv.token_usage,
                 100 * hits / queries if queries > 0 else 0.0)
        self._quiet = self._steps == 0
        self._t0 = now
        self._steps = self._prompt_tokens = self._generation_tokens = 0
