"""The ``sched`` topic's request table: running requests first, then waiting ones in queue
order, up to ``max_rows`` (10,000 and more), at the telemetry rate (10 Hz), cheaply.

Reading 10k waiting requests in queue order costs the busy loop ~10 ms of Python; at 10 Hz
that alone would take a tenth of the engine's time (and a table built on the publisher's
thread is no better: it holds the GIL the busy loop's torch calls need back). So the waiting
rows are cached as columns (`WaitingRows`) and rebuilt only every ``refresh_s`` (1 s, more
when a rebuild is slow: its cost stays under 1% of the time). Between rebuilds each snapshot
reuses them: rows of requests that left the queue since (admitted, aborted, expired: the
queue's `removed_since` log) are dropped, and every ``age_s`` is recomputed from the arrival
times. Running rows (a few hundred
at most) are built fresh every time.

Invariants: no request appears twice; the running rows and every ``age_s`` are exact at the
snapshot; the waiting rows are the queue's first rows at the last rebuild (at most ``refresh_s``
old), minus those no longer waiting. Requests queued since show at the next rebuild (early
when the queue grew past twice the cached rows); a request preempted since keeps its cached
row (state, output tokens) until then. Cached columns are never mutated: a snapshot handed to
the publisher stays as it was. Columns are numpy arrays (state as a uint8 code,
`vconsole.engine.stats.REQUEST_STATES`) and a list of ids: the publisher sends them as raw
buffers, so a snapshot costs no Python per row after a rebuild.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from vconsole.engine.request import Request
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.engine.stats import RequestTable

_NUMERIC = ("priority", "num_prompt_tokens", "num_output_tokens", "num_blocks")
REFRESH_S = 1.0
MAX_REBUILD_SHARE = 0.01


def _columns(reqs: list[Request], blocks: list[int] | None = None) -> dict[str, Any]:
    """``reqs`` as `RequestTable` columns (but ``age_s``): ids, state codes, int32 counts."""
    n = len(reqs)
    return {
        "id": [r.request_id for r in reqs],
        "state": np.fromiter((r.status for r in reqs), np.uint8, n),
        "priority": np.fromiter((r.priority for r in reqs), np.int32, n),
        "num_prompt_tokens": np.fromiter((len(r.prompt_token_ids) for r in reqs), np.int32, n),
        "num_output_tokens": np.fromiter((len(r.output_token_ids) for r in reqs), np.int32, n),
        # a waiting request holds no blocks
        "num_blocks": np.zeros(n, np.int32) if blocks is None else np.array(blocks, np.int32),
    }


class WaitingRows:
    """The cached waiting rows (see the module docstring)."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._cols: dict[str, Any] = _columns([])
        self._arrival = np.empty(0)
        self._ids: set[str] = set()         # the cached rows' ids
        self._mark = 0                      # the queue's removal log, read up to here
        self._limit = -1
        self._next_rebuild = 0.0
        self.rebuilds = 0

    def invalidate(self) -> None:
        self._next_rebuild = 0.0

    def _rebuild(self, waiting: WaitingQueue, limit: int) -> None:
        t0 = time.perf_counter()
        reqs = waiting.ordered(limit)
        self._cols = _columns(reqs)
        self._arrival = np.fromiter((r.arrival_time for r in reqs), np.float64, len(reqs))
        self._ids = set(self._cols["id"])
        self._mark = waiting.removed_since(0)[1]
        self._limit = limit
        self.rebuilds += 1
        cost = time.perf_counter() - t0
        self._next_rebuild = time.monotonic() + max(self.refresh_s, cost / MAX_REBUILD_SHARE)

    def _drop(self, ids: list[str]) -> None:
        """Forget the cached rows of ``ids`` (they left the queue: admitted, aborted, expired;
        mostly from its front, so each is found near the start). The cached columns are
        replaced, never changed in place: a table handed out earlier may share them."""
        if not ids:
            return
        cols = self._cols
        # A set: one id may be in the removal log twice (admitted, preempted back, admitted
        # again between two rebuilds) but has one row; deleting it twice from the ids and once
        # from the arrays put them out of step (the demo's crash).
        positions = sorted({cols["id"].index(rid) for rid in ids})
        keep = cols["id"][:]
        for i in reversed(positions):
            del keep[i]
        self._cols = {"id": keep, **{c: np.delete(v, positions) for c, v in cols.items()
                                     if c != "id"}}
        self._arrival = np.delete(self._arrival, positions)
        self._ids.difference_update(ids)

    def check(self, waiting: WaitingQueue) -> None:
        """Raise AssertionError unless the cache is consistent in itself: ids and every column
        equally long, no id twice (used by the stateful tests and the telemetry guard)."""
        ids = self._cols["id"]
        n = len(ids)
        assert all(len(v) == n for v in self._cols.values()) and len(self._arrival) == n, \
            "cached waiting rows: ids and columns out of step"
        assert len(self._ids) == n and set(ids) == self._ids, "cached waiting rows: ids twice"

    def table(self, running: list[Request], tables: dict[str, list[int]],
              waiting: WaitingQueue, max_waiting: int, now: float) -> RequestTable:
        """Running rows (fresh) followed by up to ``max_waiting`` waiting rows."""
        head = _columns(running, [len(tables.get(r.request_id, ())) for r in running])
        head_age = np.maximum(now - np.fromiter((r.arrival_time for r in running), np.float64,
                                                len(running)), 0.0)
        if max_waiting <= 0 or not waiting:
            return RequestTable({**head, "age_s": head_age})
        removed, mark = waiting.removed_since(self._mark)
        if (removed is None or max_waiting > self._limit
                or time.monotonic() >= self._next_rebuild
                or len(self._arrival) < min(max_waiting, len(waiting)) // 2):
            # Headroom: the number of running rows (and so the waiting rows wanted) moves.
            self._rebuild(waiting, max_waiting + max_waiting // 8 + 8)
            removed = []
        self._mark = mark
        self._drop([rid for rid in removed if rid in self._ids])
        cols, arrival = self._cols, self._arrival[:max_waiting]
        if len(cols["id"]) != len(self._arrival):   # O(1): never send a table out of step
            raise RuntimeError(f"cached waiting rows out of step: {len(cols['id'])} ids, "
                               f"{len(self._arrival)} rows")
        out: dict[str, Any] = {"id": head["id"] + cols["id"][:max_waiting]}
        for c in ("state", *_NUMERIC):
            out[c] = np.concatenate((head[c], cols[c][:max_waiting]))
        out["age_s"] = np.concatenate((head_age, np.maximum(now - arrival, 0.0)))
        return RequestTable(out)
