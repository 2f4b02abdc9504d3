"""The ``sched`` topic's request table: running requests first, then waiting ones in queue
order, up to ``max_rows`` (10,000 and more), at the telemetry rate (10 Hz), cheaply.

Reading 10k waiting requests in queue order request by request cost the busy loop 10-45 ms of
Python; at 10 Hz that alone would take a tenth of the engine's time (and a table built on the
publisher's thread is no better: it holds the GIL the busy loop's torch calls need back). So
the waiting queue keeps each waiting request's row in flat arrays, written once when it
enters (`WaitingQueue.row_order` / `rows`: numpy sorts and gathers them), and the rows are
cached as columns (`WaitingRows`), refreshed only every ``refresh_s`` (1 s, more when a
refresh is slow: its cost stays under 1% of the time). A timed refresh is spread over several
snapshots: it takes the queue's order once and gathers `REFRESH_CHUNK` positions of it per
snapshot, so no snapshot pays for a whole table; meanwhile the old rows keep serving. Between refreshes each snapshot reuses the rows:
those of requests that left the queue since (admitted, aborted, expired: the queue's
`removed_since` log) are dropped, and every ``age_s`` is recomputed from the arrival times.
When the cached rows cannot serve (first snapshot, a new policy order, more rows wanted, fewer
than half the wanted rows left, the removal log overflowed) the refresh is done at once.
Running rows (a few hundred at most) are built fresh every time.

Invariants: no request appears twice; the running rows and every ``age_s`` are exact at the
snapshot; the waiting rows are the queue's first rows at the start of the last completed
refresh (at most ``refresh_s`` plus a few snapshots old), minus those no longer waiting, each
read while it waited. Requests queued since show after the next refresh (early when the
queue grew past twice the cached rows); a request preempted since keeps its cached row (state,
output tokens) until then. Cached columns are never mutated: a snapshot handed to the
publisher stays as it was. Columns are numpy arrays (state as a uint8 code,
`vconsole.shared.stats.REQUEST_STATES`) and a list of ids: the publisher sends them as raw
buffers, so a snapshot costs no Python per row after a refresh.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from vconsole.engine.request import Request
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.shared.stats import RequestTable

_NUMERIC = ("priority", "num_prompt_tokens", "num_output_tokens", "num_blocks", "constraint",
            "compile_ms")
REFRESH_S = 1.0
MAX_REBUILD_SHARE = 0.01
REFRESH_CHUNK = 4096    # positions of the queue order a timed refresh reads per snapshot


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
        "constraint": np.fromiter((r.constraint for r in reqs), np.uint8, n),
        "compile_ms": np.fromiter((r.compile_ms for r in reqs), np.float32, n),
    }


class _Refresh:
    """A refresh under way: the queue's order at its start (`WaitingQueue.row_order`: slots
    sorted by numpy), whose rows are gathered a chunk of positions at a time; ``mark`` is the
    removal log's position at the start. No Python per row."""

    __slots__ = ("waiting", "slots", "counters", "pos", "mark", "limit", "parts", "num_rows",
                 "cost")

    def __init__(self, waiting: WaitingQueue, limit: int) -> None:
        t0 = time.perf_counter()
        self.waiting = waiting
        self.slots, self.counters = waiting.row_order()
        self.pos = 0
        self.mark = waiting.removed_since(0)[1]
        self.limit = limit
        self.parts: list[dict[str, Any]] = []
        self.num_rows = 0
        self.cost = time.perf_counter() - t0    # busy-loop seconds spent on this refresh

    def read(self, chunk: int | None) -> bool:
        """Read up to ``chunk`` more positions of the order (None: all left); a stay that left
        the queue since the start gives no row. True once complete."""
        t0 = time.perf_counter()
        end = len(self.slots) if chunk is None else min(len(self.slots), self.pos + chunk)
        while self.pos < end and self.num_rows < self.limit:
            stop = min(end, self.pos + self.limit - self.num_rows)
            part = self.waiting.rows(self.slots[self.pos:stop], self.counters[self.pos:stop])
            self.pos = stop
            self.parts.append(part)
            self.num_rows += len(part["id"])
        self.cost += time.perf_counter() - t0
        return self.pos >= len(self.slots) or self.num_rows >= self.limit

    def columns(self) -> tuple[dict[str, Any], np.ndarray]:
        """The rows read, as cached columns (but ``age_s``) and arrival times."""
        parts = self.parts or [self.waiting.rows(self.slots[:0], self.counters[:0])]
        ids = parts[0]["id"] if len(parts) == 1 else [i for p in parts for i in p["id"]]
        cols = {c: parts[0][c] if len(parts) == 1 else np.concatenate([p[c] for p in parts])
                for c in ("state", "priority", "num_prompt_tokens", "num_output_tokens",
                          "arrival", "constraint", "compile_ms")}
        arrival = cols.pop("arrival")
        cols["num_blocks"] = np.zeros(len(ids), np.int32)   # a waiting request holds none
        return {"id": ids, **cols}, arrival


class WaitingRows:
    """The cached waiting rows (see the module docstring)."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._cols: dict[str, Any] = _columns([])
        self._skip = 0                      # leading ids of ``_cols["id"]`` already dropped
        self._arrival = np.empty(0)
        self._ids: set[str] = set()         # the cached rows' ids
        self._mark = 0                      # the queue's removal log, read up to here
        self._limit = -1
        self._next_rebuild = 0.0
        self._stale = False                 # a new order: the cached rows cannot serve
        self._refresh: _Refresh | None = None
        self.rebuilds = 0                   # refreshes completed

    def invalidate(self) -> None:
        """The queue's order changed (a new policy): the next snapshot reads it afresh."""
        self._stale = True

    def _run_refresh(self, waiting: WaitingQueue, limit: int, chunk: int | None) -> None:
        """Start a refresh unless one is under way, read ``chunk`` rows of it (None: all),
        and put its rows in place once complete."""
        if self._refresh is None:
            self._refresh = _Refresh(waiting, limit)
        job = self._refresh
        if not job.read(chunk):
            return
        self._refresh = None
        self._cols, self._arrival = job.columns()
        self._skip = 0
        self._ids = set(self._cols["id"])
        self._mark = job.mark
        self._limit = job.limit
        self._stale = False
        self.rebuilds += 1
        self._next_rebuild = time.monotonic() + max(self.refresh_s,
                                                    job.cost / MAX_REBUILD_SHARE)

    def _rebuild(self, waiting: WaitingQueue, limit: int) -> None:
        """A whole refresh at once (one under way is dropped)."""
        self._refresh = None
        self._run_refresh(waiting, limit, None)

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
        skip = self._skip
        positions = sorted({cols["id"].index(rid, skip) - skip for rid in ids})
        if positions[-1] == len(positions) - 1:
            # The front rows only (admitted): the arrays become views, and the id list is
            # not copied (10k strings touched per copy) but read from a later start.
            k = len(positions)
            self._skip += k
            self._cols = {c: v if c == "id" else v[k:] for c, v in cols.items()}
            self._arrival = self._arrival[k:]
            self._ids.difference_update(ids)
            return
        keep = cols["id"][skip:]
        self._skip = 0
        for i in reversed(positions):
            del keep[i]
        self._cols = {"id": keep, **{c: np.delete(v, positions) for c, v in cols.items()
                                     if c != "id"}}
        self._arrival = np.delete(self._arrival, positions)
        self._ids.difference_update(ids)

    def check(self, waiting: WaitingQueue) -> None:
        """Raise AssertionError unless the cache is consistent in itself: ids and every column
        equally long, no id twice (used by the stateful tests and the telemetry guard)."""
        ids = self._cols["id"][self._skip:]
        n = len(ids)
        assert all(len(v) == n for c, v in self._cols.items() if c != "id") \
            and len(self._arrival) == n, \
            "cached waiting rows: ids and columns out of step"
        assert len(self._ids) == n and set(ids) == self._ids, "cached waiting rows: ids twice"

    def table(self, running: list[Request], tables: dict[str, list[int]],
              waiting: WaitingQueue, max_waiting: int, now: float) -> RequestTable:
        """Running rows (fresh) followed by up to ``max_waiting`` waiting rows. ``running``
        may end with requests that are neither (compiling: the scheduler's head rows, built
        fresh as the running ones are)."""
        head = _columns(running, [len(tables.get(r.request_id, ())) for r in running])
        head_age = np.maximum(now - np.fromiter((r.arrival_time for r in running), np.float64,
                                                len(running)), 0.0)
        if max_waiting <= 0 or not waiting:
            return RequestTable({**head, "age_s": head_age})
        removed, _ = waiting.removed_since(self._mark)
        # Headroom: the number of running rows (and so the waiting rows wanted) moves.
        limit = max_waiting + max_waiting // 8 + 8
        if (self._stale or removed is None or max_waiting > self._limit
                or len(self._arrival) < min(max_waiting, len(waiting)) // 2):
            self._rebuild(waiting, limit)
        elif self._refresh is not None or time.monotonic() >= self._next_rebuild:
            self._run_refresh(waiting, limit, REFRESH_CHUNK)
        removed, mark = waiting.removed_since(self._mark)
        if removed is None:             # the log overflowed during a spread refresh
            self._rebuild(waiting, limit)
            removed, mark = waiting.removed_since(self._mark)
        self._mark = mark
        self._drop([rid for rid in removed or () if rid in self._ids])
        cols, arrival = self._cols, self._arrival[:max_waiting]
        ids, skip = cols["id"], self._skip
        if len(ids) - skip != len(self._arrival):   # O(1): never send a table out of step
            raise RuntimeError(f"cached waiting rows out of step: {len(ids) - skip} ids, "
                               f"{len(self._arrival)} rows")
        out: dict[str, Any] = {"id": head["id"] + ids[skip:skip + max_waiting]}
        for c in ("state", *_NUMERIC):
            out[c] = np.concatenate((head[c], cols[c][:max_waiting]))
        out["age_s"] = np.concatenate((head_age, np.maximum(now - arrival, 0.0)))
        return RequestTable(out)
