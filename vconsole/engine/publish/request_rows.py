"""The ``sched`` topic's request table: running requests first, then waiting ones in queue
order, up to ``max_rows`` (10,000 and more), at the telemetry rate (10 Hz), cheaply.

Reading 10k waiting requests in queue order request by request cost the busy loop 10-45 ms of
Python; at 10 Hz that alone would take a tenth of the engine's time (and a table built on the
publisher's thread is no better: it holds the GIL the busy loop's torch calls need back). So
a log beside the waiting queue keeps each waiting request's row in flat arrays, written once
when it enters (`vconsole.engine.publish.queue_log.QueueLog.row_order` / ``rows``: numpy sorts
and gathers them), and the rows are cached as columns (`WaitingRows`), refreshed only every
``refresh_s`` (1 s, more when a refresh is slow: its cost stays under 1% of the time). A timed refresh is spread over several
snapshots: it takes the queue's order once and gathers `REFRESH_CHUNK` positions of it per
snapshot, so no snapshot pays for a whole table; meanwhile the old rows keep serving. Between refreshes each snapshot reuses the rows:
those of requests that left the queue since (admitted, aborted, expired: the log's
``removed_since``) are dropped, and every ``age_s`` is recomputed from the arrival times.
When the cached rows cannot serve (first snapshot, a new policy order, more rows wanted, fewer
than half the wanted rows left, the removal log overflowed) the refresh is done at once.
Running rows (a few hundred at most) are built fresh every time.

Invariants: no request appears twice; the running rows and every ``age_s`` are exact at the
snapshot; the waiting rows are the queue's first rows at the start of the last completed
refresh (at most ``refresh_s`` plus a few snapshots old), minus those no longer waiting, each
read while it waited. Requests queued since show after the next refresh (early when the
queue grew past twice the cached rows); a request preempted since keeps its cached row (state,
output tokens) until then.

The cached rows are one immutable `WaitingBlock` per refresh (an admission skips its front
rows; another removal makes a new block), and a table is its parts until first read
(`JoinedRows`: the running rows, then ``n`` rows of the block from ``start``, aged at ``now``).
Columns are numpy arrays (state as a uint8 code, `vconsole.shared.stats.REQUEST_STATES`) and a
list of ids.

With a publisher process, the busy loop does not even do this: its snapshot's table is a
`QueueRows` (the running rows as read from the requests, `head_rows`, and the queue's log), the
hand-off sends what changed in the queue, and the publisher process runs these same
`WaitingRows` over its mirror of it (`vconsole.engine.publish.queue_mirror`).

The scheduler asks for the table through `RequestRows` (its ``rows`` argument,
`vconsole.engine.sched.scheduler.RowSource`): it attaches the log to the queue at its first
table and makes either kind.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from vconsole.engine.publish.queue_log import QueueLog
from vconsole.engine.request import Request
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


class WaitingBlock:
    """Cached waiting rows as one immutable unit: columns (but ``age_s``: ``id`` a list, the
    rest numpy) and arrival times, never changed once made — a table built on them reads them
    as they were."""

    __slots__ = ("cols", "arrival")

    def __init__(self, cols: dict[str, Any], arrival: np.ndarray) -> None:
        self.cols, self.arrival = cols, arrival

    def __len__(self) -> int:
        return len(self.arrival)

    def without(self, start: int, positions: list[int]) -> WaitingBlock:
        """Rows ``start:`` less those at ``positions`` (sorted, relative to ``start``)."""
        keep = self.cols["id"][start:]
        for i in reversed(positions):
            del keep[i]
        return WaitingBlock({"id": keep, **{c: np.delete(v[start:], positions)
                                            for c, v in self.cols.items() if c != "id"}},
                            np.delete(self.arrival[start:], positions))


class JoinedRows:
    """A ``sched`` table as its parts (`vconsole.shared.stats.TableParts`): ``head`` (fresh
    columns of the running rows, ``age_s`` included), then rows ``start:start + n`` of
    ``block``, aged at ``now``. `columns` joins them; a hand-off may send the parts instead."""

    __slots__ = ("head", "block", "start", "n", "now")

    def __init__(self, head: dict[str, Any], block: WaitingBlock, start: int, n: int,
                 now: float) -> None:
        self.head, self.block, self.start, self.n, self.now = head, block, start, n, now

    def __len__(self) -> int:
        return len(self.head["id"]) + self.n

    def columns(self) -> dict[str, Any]:
        head, cols, a, b = self.head, self.block.cols, self.start, self.start + self.n
        out: dict[str, Any] = {"id": head["id"] + cols["id"][a:b]}
        for c in ("state", *_NUMERIC):
            out[c] = np.concatenate((head[c], cols[c][a:b]))
        out["age_s"] = np.concatenate((head["age_s"],
                                       np.maximum(self.now - self.block.arrival[a:b], 0.0)))
        return out


class QueueView(Protocol):
    """What the cached rows read of a queue: its log (`QueueLog`), or its mirror in a publisher
    process (`vconsole.engine.publish.queue_mirror.QueueMirror`)."""

    def __len__(self) -> int: ...
    def row_order(self) -> tuple[np.ndarray, np.ndarray]: ...
    def rows(self, slots: np.ndarray, counters: np.ndarray) -> dict[str, Any]: ...
    def removed_since(self, mark: int) -> tuple[list[str] | None, int]: ...


class _Refresh:
    """A refresh under way: the queue's order at its start (`QueueLog.row_order`: slots
    sorted by numpy), whose rows are gathered a chunk of positions at a time; ``mark`` is the
    removal log's position at the start. No Python per row."""

    __slots__ = ("waiting", "slots", "counters", "pos", "mark", "limit", "parts", "num_rows",
                 "cost")

    def __init__(self, waiting: QueueView, limit: int) -> None:
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
        self._block = WaitingBlock(_columns([]), np.empty(0))
        self._skip = 0                      # leading rows of ``_block`` already dropped
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

    def _run_refresh(self, waiting: QueueView, limit: int, chunk: int | None) -> None:
        """Start a refresh unless one is under way, read ``chunk`` rows of it (None: all),
        and put its rows in place once complete."""
        if self._refresh is None:
            self._refresh = _Refresh(waiting, limit)
        job = self._refresh
        if not job.read(chunk):
            return
        self._refresh = None
        self._block = WaitingBlock(*job.columns())
        self._skip = 0
        self._ids = set(self._block.cols["id"])
        self._mark = job.mark
        self._limit = job.limit
        self._stale = False
        self.rebuilds += 1
        self._next_rebuild = time.monotonic() + max(self.refresh_s,
                                                    job.cost / MAX_REBUILD_SHARE)

    def _rebuild(self, waiting: QueueView, limit: int) -> None:
        """A whole refresh at once (one under way is dropped)."""
        self._refresh = None
        self._run_refresh(waiting, limit, None)

    def _drop(self, ids: list[str]) -> None:
        """Forget the cached rows of ``ids`` (they left the queue: admitted, aborted, expired;
        mostly from its front, so each is found near the start). The block is never changed in
        place: the front rows are skipped, other rows make a new block (`WaitingBlock.without`)."""
        if not ids:
            return
        block, skip = self._block, self._skip
        # A set: one id may be in the removal log twice (admitted, preempted back, admitted
        # again between two rebuilds) but has one row; deleting it twice from the ids and once
        # from the arrays put them out of step (the demo's crash).
        positions = sorted({block.cols["id"].index(rid, skip) - skip for rid in ids})
        if positions[-1] == len(positions) - 1:
            self._skip += len(positions)     # the front rows only (admitted): O(1)
        else:
            self._block, self._skip = block.without(skip, positions), 0
        self._ids.difference_update(ids)

    def check(self, waiting: QueueView) -> None:
        """Raise AssertionError unless the cache is consistent in itself: ids and every column
        equally long, no id twice (used by the stateful tests and the telemetry guard)."""
        block, skip = self._block, self._skip
        ids = block.cols["id"][skip:]
        n = len(ids)
        assert all(len(v) - skip == n for c, v in block.cols.items() if c != "id") \
            and len(block.arrival) - skip == n, \
            "cached waiting rows: ids and columns out of step"
        assert len(self._ids) == n and set(ids) == self._ids, "cached waiting rows: ids twice"

    def table(self, running: list[Request], tables: dict[str, list[int]],
              waiting: QueueView, max_waiting: int, now: float) -> RequestTable:
        """Running rows (fresh) followed by up to ``max_waiting`` waiting rows. ``running``
        may end with requests that are neither (compiling: the scheduler's head rows, built
        fresh as the running ones are)."""
        return self.joined(head_columns(head_rows(running, tables), now), waiting,
                           max_waiting, now)

    def joined(self, head: dict[str, Any], waiting: QueueView,
               max_waiting: int, now: float) -> RequestTable:
        """``head`` (`head_columns`) followed by up to ``max_waiting`` cached waiting rows of
        ``waiting`` (the queue's log, or its mirror in a publisher process)."""
        if max_waiting <= 0 or not waiting:
            return RequestTable(head)
        removed, _ = waiting.removed_since(self._mark)
        # Headroom: the number of running rows (and so the waiting rows wanted) moves.
        limit = max_waiting + max_waiting // 8 + 8
        if (self._stale or removed is None or max_waiting > self._limit
                or len(self._block) - self._skip < min(max_waiting, len(waiting)) // 2):
            self._rebuild(waiting, limit)
        elif self._refresh is not None or time.monotonic() >= self._next_rebuild:
            self._run_refresh(waiting, limit, REFRESH_CHUNK)
        removed, mark = waiting.removed_since(self._mark)
        if removed is None:             # the log overflowed during a spread refresh
            self._rebuild(waiting, limit)
            removed, mark = waiting.removed_since(self._mark)
        self._mark = mark
        self._drop([rid for rid in removed or () if rid in self._ids])
        block, skip = self._block, self._skip
        if len(block.cols["id"]) != len(block.arrival):  # O(1): never send rows out of step
            raise RuntimeError(f"cached waiting rows out of step: {len(block.cols['id'])} "
                               f"ids, {len(block.arrival)} rows")
        n = max(0, min(max_waiting, len(block) - skip))
        return RequestTable(parts=JoinedRows(head, block, skip, n, now))


HeadRows = tuple[list[str], list[float]]   # ids, and `HEAD_FIELDS` per row in one flat list
HEAD_FIELDS = 8


def head_rows(running: list[Request], tables: dict[str, list[int]]) -> HeadRows:
    """The running (and compiling) rows as read from the requests: their ids, and state,
    priority, prompt and output tokens, blocks, constraint, compile ms and arrival time per row
    in one flat list — one pass, no numpy (what the busy loop pays; `head_columns` makes the
    columns, in the publisher process when it has one)."""
    flat: list[float] = []
    extend = flat.extend
    for r in running:
        extend((r.status, r.priority, len(r.prompt_token_ids), len(r.output_token_ids),
                len(tables.get(r.request_id, ())), r.constraint, r.compile_ms, r.arrival_time))
    return [r.request_id for r in running], flat


def head_columns(head: HeadRows, now: float) -> dict[str, Any]:
    """`head_rows` as the table's columns, ``age_s`` at ``now``."""
    ids, flat = head
    values = np.fromiter(flat, np.float64, len(flat)).reshape(len(ids), HEAD_FIELDS).T
    return {"id": list(ids),
            "state": values[0].astype(np.uint8),
            "priority": values[1].astype(np.int32),
            "num_prompt_tokens": values[2].astype(np.int32),
            "num_output_tokens": values[3].astype(np.int32),
            "num_blocks": values[4].astype(np.int32),
            "constraint": values[5].astype(np.uint8),
            "compile_ms": values[6].astype(np.float32),
            "age_s": np.maximum(now - values[7], 0.0)}


class QueueRows:
    """A ``sched`` table whose waiting rows a publisher process joins from its mirror of the
    queue (`vconsole.engine.publish.queue_mirror`): ``head`` (`head_rows`), the queue's ``log``,
    how many waiting rows, and when. The hand-off sends the head and what changed in the
    queue; joined here (`columns`: a test, a reader in this process), the waiting rows are read
    from the log at once, in queue order."""

    __slots__ = ("head", "log", "max_waiting", "now")

    def __init__(self, head: HeadRows, log: QueueLog, max_waiting: int, now: float) -> None:
        self.head, self.log, self.max_waiting, self.now = head, log, max_waiting, now

    def __len__(self) -> int:
        return len(self.head[0]) + max(0, min(self.max_waiting, len(self.log)))

    def first_ids(self, n: int) -> list[str]:
        """The first ``n`` ids: the head's, then the queue's front in its order."""
        ids = self.head[0][:n]
        rest = min(n - len(ids), self.max_waiting, len(self.log))
        if rest > 0:
            slots, counters = self.log.row_order()
            ids = ids + self.log.rows(slots[:rest], counters[:rest])["id"]
        return ids

    def columns(self) -> dict[str, Any]:
        rows = WaitingRows(refresh_s=0.0)
        return rows.joined(head_columns(self.head, self.now), self.log, self.max_waiting,
                           self.now).columns


class ListenedQueue(Protocol):
    """What `RequestRows` needs of a queue: to attach its log
    (`vconsole.engine.sched.request_queue.WaitingQueue`)."""

    @property
    def listener(self) -> object: ...
    def listen(self, listener: QueueLog) -> None: ...


class RequestRows:
    """The ``sched`` table of one scheduler, as the publishing side makes it: what the
    scheduler's ``stats(max_rows, rows)`` asks (`vconsole.engine.sched.scheduler.RowSource`).

    At its first table it attaches a `QueueLog` to the queue (the log then follows every write;
    before, the queue paid nothing). ``mirrored``: the table is a `QueueRows` whose waiting rows
    a publisher process joins from its mirror (the busy loop pays for the running rows only);
    otherwise the cached `WaitingRows` over the log, joined here. `reset` (after the ``sched``
    part failed: `vconsole.engine.telemetry_guard`) drops the log and the cached rows: the next
    table reads the queue afresh (and a mirror gets it whole)."""

    def __init__(self, mirrored: bool = False, refresh_s: float = REFRESH_S) -> None:
        self.mirrored = mirrored
        self.refresh_s = refresh_s
        self.log: QueueLog | None = None
        self.cached = WaitingRows(refresh_s)
        self._order_changes = 0          # the log's, as the cached rows last saw it

    def reset(self) -> None:
        self.log = None
        self.cached = WaitingRows(self.refresh_s)

    def log_of(self, queue: ListenedQueue) -> QueueLog:
        """The queue's log: attached now unless it already listens (a new one starts the
        cached rows over)."""
        log = self.log
        if log is None or queue.listener is not log:
            log = self.log = QueueLog()
            queue.listen(log)
            self.cached = WaitingRows(self.refresh_s)
            self._order_changes = 0
        return log

    def table(self, head: list[Request], tables: dict[str, list[int]], queue: ListenedQueue,
              max_waiting: int, now: float) -> RequestTable:
        """``head`` (running, then compiling requests; ``tables`` their block tables) as fresh
        rows, then up to ``max_waiting`` rows of ``queue``'s waiting requests in its order."""
        log = self.log_of(queue)
        if self.mirrored:
            return RequestTable(parts=QueueRows(head_rows(head, tables), log, max_waiting, now))
        if log.order_changes != self._order_changes:    # a new order: read it afresh
            self._order_changes = log.order_changes
            self.cached.invalidate()
        return self.cached.table(head, tables, log, max_waiting, now)
