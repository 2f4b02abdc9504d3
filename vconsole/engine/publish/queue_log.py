"""The waiting queue as telemetry reads it: a numbered log of its stays, kept beside the queue.

Why: the ``sched`` table lists up to 10,000 waiting requests in queue order ten times a second.
Reading them request by request costs the busy loop 10-45 ms of Python, so telemetry keeps each
stay in the queue (an ``add``, until the request leaves) in flat arrays instead, written once
when it begins: `row_order` sorts the live slots with numpy and `rows` gathers their columns, so
reading 10,000 rows in queue order costs no Python per row. The queue itself holds policy only:
a `QueueLog` follows it as its listener (`WaitingQueue.listen`: the queue tells it of every stay
that begins or ends and of every new order), so a queue nobody publishes (the what-if, the
scheduler's tests and benches) pays nothing for it.

What it keeps: the stay columns (`StayColumns`: one `STAY_DTYPE` record per stay, every write
numbered, for the publisher process's mirror: `vconsole.engine.publish.queue_mirror`), the ids
that left in order (`RemovalLog`, for the cached rows: `vconsole.engine.publish.request_rows`),
and how many times the order changed (``order_changes``).

Invariant: from `WaitingQueue.listen` on, the live slots are exactly the queue's waiting
requests, each with the key of its heap entry; ``len`` is the queue's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vconsole.engine.request import Request

Key = tuple[float, ...]
Entry = tuple[Key, int, Request]   # the queue's heap entry: (policy key, counter, request)

STAY_DTYPE = np.dtype([("counter", np.int64), ("key", np.float64), ("seq", np.int64),
                       ("arrival", np.float64), ("priority", np.int32),
                       ("num_prompt_tokens", np.int32), ("num_output_tokens", np.int32),
                       ("compile_ms", np.float32), ("started", np.uint8), ("state", np.uint8),
                       ("constraint", np.uint8)])
MAX_WRITE_LOG = 1 << 14   # writes logged: a reader further behind reads every slot
MAX_REMOVED_LOG = 1 << 16


class StayColumns:
    """One slot per stay in the queue: a record of `STAY_DTYPE` and its id (grown by
    doubling; freed slots reused). ``cols``: each field as an array (views of the records).

    Invariant: slot ``i`` is live iff ``counter[i] != 0``, and then it holds the stay whose
    heap entry is ``(key, counter[i], req)`` with ``key == (key[i], started[i], seq[i])``; the
    row columns are the request's at ``add`` (they do not change while it waits). Every write
    (put, re-key, clear) is numbered: write ``log_base + k + 1`` wrote slot ``log[k]``, and
    ``changes`` is the last number given (`QueueLog.changes_since`). The log holds at most
    ``max(MAX_WRITE_LOG, 2 * high)`` slots."""

    def __init__(self, capacity: int = 1024) -> None:
        self.records = np.zeros(capacity, STAY_DTYPE)
        self.ids = np.empty(capacity, object)
        self.cols = self._views()
        self.log: list[int] = []
        self.log_base = 0
        self.changes = 0
        self.high = 0                 # slots ever used: live ones are below
        self.free: list[int] = []

    def _views(self) -> dict[str, np.ndarray]:
        return {**{name: self.records[name] for name in STAY_DTYPE.names or ()},
                "id": self.ids}

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (by doubling)."""
        size = len(self.records)
        if capacity <= size:
            return
        while size < capacity:
            size *= 2
        extra = size - len(self.records)
        self.records = np.concatenate((self.records, np.zeros(extra, STAY_DTYPE)))
        self.ids = np.concatenate((self.ids, np.empty(extra, object)))
        self.cols = self._views()

    def _trim(self) -> None:
        """The write log outgrew its cap: keep the newer half (a reader near the end still
        reads only what it missed)."""
        log = self.log
        cap = max(MAX_WRITE_LOG, 2 * self.high)
        if len(log) > cap:
            drop = len(log) - cap // 2
            del log[:drop]
            self.log_base += drop

    # `put` and `clear` run on the busy loop for every stay: the numbering is written out in
    # each (no call), the trimming only when the log may be over its cap.
    def put(self, entry: Entry) -> int:
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.high
            if slot >= len(self.records):
                self.grow(slot + 1)
            self.high += 1
        (key, started, seq), counter, req = entry
        self.records[slot] = (counter, key, seq, req.arrival_time, req.priority,
                              len(req.prompt_token_ids), len(req.output_token_ids),
                              req.compile_ms, started, req.status, req.constraint)
        self.ids[slot] = req.request_id
        self.changes += 1
        log = self.log
        log.append(slot)
        if len(log) > MAX_WRITE_LOG:
            self._trim()
        return slot

    def rekey(self, slot: int, key: Key) -> None:
        self.cols["key"][slot], self.cols["started"][slot], self.cols["seq"][slot] = key
        self.changes += 1
        self.log.append(slot)
        self._trim()

    def clear(self, slot: int) -> None:
        self.cols["counter"][slot] = 0
        self.ids[slot] = None
        self.free.append(slot)
        self.changes += 1
        log = self.log
        log.append(slot)
        if len(log) > MAX_WRITE_LOG:
            self._trim()

    def written_since(self, since: int) -> list[int]:
        """The slots written after write number ``since`` (sorted, each once)."""
        if since >= self.log_base:
            return sorted(set(self.log[since - self.log_base:]))
        return list(range(self.high))    # the log no longer reaches back: all

    def row_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Every live slot in scheduling order (heap key, then insertion), and its counter."""
        cols = self.cols
        counter = cols["counter"][:self.high]
        live = np.flatnonzero(counter)
        order = np.lexsort((counter[live], cols["seq"][live], cols["started"][live],
                            cols["key"][live]))
        slots = live[order]
        return slots, counter[slots]

    def rows(self, slots: np.ndarray, counters: np.ndarray) -> dict[str, Any]:
        """The rows of those slots still holding the same stay, in the given order: ``id`` a
        list, the other columns arrays (``arrival`` the arrival times)."""
        cols = self.cols
        slots = slots[cols["counter"][slots] == counters]
        out = {c: cols[c][slots] for c in ("state", "priority", "num_prompt_tokens",
                                           "num_output_tokens", "arrival", "constraint",
                                           "compile_ms")}
        out["id"] = cols["id"][slots].tolist()
        return out


class RemovalLog:
    """The ids that left the queue (admitted, aborted, expired), in order, numbered from 0;
    past `MAX_REMOVED_LOG` it starts over and a reader further behind must re-read the queue.
    Appends go to ``ids`` itself (`QueueLog.removed`, on the busy loop), then `trim`."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._base = 0                  # how many were dropped from the front

    def trim(self) -> None:
        if len(self.ids) > MAX_REMOVED_LOG:
            self._base += len(self.ids)
            self.ids = []

    def extend(self, request_ids: list[str]) -> None:
        self.ids.extend(request_ids)
        self.trim()

    def since(self, mark: int) -> tuple[list[str] | None, int]:
        """Ids that left since ``mark``, and the mark to pass next time (0 at first). None
        when the log no longer reaches back that far."""
        end = self._base + len(self.ids)
        if mark < self._base:
            return None, end
        return self.ids[mark - self._base:], end


class QueueLog:
    """A `WaitingQueue`'s listener (`vconsole.engine.sched.request_queue.QueueListener`) that
    keeps its stays, removals and order changes (see the module docstring); what the cached
    rows and the mirror's sender read of the queue. One per queue."""

    def __init__(self) -> None:
        self.stays = StayColumns()
        self.removals = RemovalLog()
        self._slot: dict[str, int] = {}  # id -> its slot in `stays`
        self.order_changes = 0           # new orders (a policy change: every stay re-keyed)

    # --- the queue's listener (the busy loop) ---------------------------------------------------
    def added(self, entry: Entry) -> None:
        self._slot[entry[2].request_id] = self.stays.put(entry)

    def removed(self, request_id: str) -> None:
        self.stays.clear(self._slot.pop(request_id))
        ids = self.removals.ids
        ids.append(request_id)
        if len(ids) > MAX_REMOVED_LOG:
            self.removals.trim()

    def reordered(self, changed: list[tuple[str, Key]]) -> None:
        rekey, slot = self.stays.rekey, self._slot
        for rid, key in changed:
            rekey(slot[rid], key)
        self.order_changes += 1

    # --- what readers see (`request_rows.QueueView`) --------------------------------------------
    def __len__(self) -> int:
        return len(self._slot)

    def row_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stay now in the queue, in scheduling order, as (slots, counters): the order
        `WaitingQueue.ordered` gives (heap key, then insertion), sorted by numpy."""
        return self.stays.row_order()

    def rows(self, slots: np.ndarray, counters: np.ndarray) -> dict[str, Any]:
        """The rows of those stays (from `row_order`) still in the queue, in the given order:
        ``id`` a list, the other columns arrays (``arrival`` the arrival times)."""
        return self.stays.rows(slots, counters)

    def removed_since(self, mark: int) -> tuple[list[str] | None, int]:
        """Ids that left the queue since ``mark`` (`RemovalLog.since`)."""
        return self.removals.since(mark)

    def changes_since(self, since: int) -> tuple[list[int], np.ndarray, list[Any], int, int]:
        """The slots written after write number ``since`` (added, re-keyed, removed: 0 for
        all), their records and ids as they are now, the number to pass next time and the
        slots in use. O(writes since) from the write log; O(slots) when it no longer reaches
        back (`vconsole.engine.publish.queue_mirror`)."""
        st = self.stays
        slots = st.written_since(since)
        ids = st.ids
        return slots, st.records[slots], [ids[i] for i in slots], st.changes, st.high
