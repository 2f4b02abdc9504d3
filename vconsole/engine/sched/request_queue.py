"""The waiting queue: a heap ordered by the scheduling policy, cheap at 10k+ requests.

Ordering (lower key = scheduled sooner):

* ``fcfs``: arrival order into the scheduler (``seq_no``).
* ``priority``: ``(priority, seq_no)``; a lower priority value is more urgent.
* ``hybrid``: priority with aging. A request's effective priority is its priority value lowered
  by one for every ``hybrid_aging_s`` seconds it has waited:
  ``priority - (now - arrival_time) / hybrid_aging_s``. The ``now`` term is the same for every
  request, so the order is that of the *static* key ``priority + arrival_time / hybrid_aging_s``:
  keys never change while requests wait, and the heap needs no re-sorting as time passes. A
  request of priority p that arrived ``k * hybrid_aging_s`` seconds before one of priority
  p - k ties with it, and overtakes it when older still.

A preempted request goes back to the front of its class: its key gains a ``0`` flag ahead of the
``1`` of requests that never ran, in the position that makes it precede every not-yet-started
request with the same priority (fcfs: the whole queue is one class). Under ``hybrid`` the class
key is continuous; there the flag only breaks exact ties, and a preempted request is ahead of
every not-yet-started request of its priority because those arrived after it was admitted.

Removal (abort, timeout) is lazy: ``_live`` maps request id -> its current heap entry, and an
entry popped from a heap counts only if it is still that request's live entry. Heaps are rebuilt
when stale entries outnumber live ones, so memory stays O(live).

Telemetry reads the queue as rows (`vconsole.engine.sched.request_rows`) from `StayColumns`:
each stay in the queue (an ``add``, until the request leaves) holds a slot in flat arrays with
its sort key and what its row shows, written once at ``add``; `row_order` sorts the live slots
with numpy and `rows` gathers columns, so reading 10,000 rows in queue order costs no Python
per row.

A second heap, keyed by enqueue time, finds requests waiting longer than ``max_holding_seconds``
in O(expired * log n). Only requests that never ran time out; a preempted request is exempt (the
scheduler, not the client's patience, put it back in the queue).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import numpy as np

from vconsole.engine.request import Request, RequestStatus

_Key = tuple[float, ...]
MAX_REMOVED_LOG = 1 << 16
_Entry = tuple[_Key, int, Request]  # (policy key, insertion counter, request)


STAY_DTYPE = np.dtype([("counter", np.int64), ("key", np.float64), ("seq", np.int64),
                       ("arrival", np.float64), ("priority", np.int32),
                       ("num_prompt_tokens", np.int32), ("num_output_tokens", np.int32),
                       ("compile_ms", np.float32), ("started", np.uint8), ("state", np.uint8),
                       ("constraint", np.uint8)])
MAX_WRITE_LOG = 1 << 14   # writes logged: a reader further behind reads every slot


class StayColumns:
    """One slot per stay in the queue: a record of `STAY_DTYPE` and its id (grown by
    doubling; freed slots reused). ``cols``: each field as an array (views of the records).

    Invariant: slot ``i`` is live iff ``counter[i] != 0``, and then it holds the stay whose
    heap entry is ``(key, counter[i], req)`` with ``key == (key[i], started[i], seq[i])``; the
    row columns are the request's at ``add`` (they do not change while it waits). Every write
    (put, re-key, clear) is numbered: write ``log_base + k + 1`` wrote slot ``log[k]``, and
    ``changes`` is the last number given (`WaitingQueue.changes_since`)."""

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

    def _wrote(self, slot: int) -> None:
        self.changes += 1
        log = self.log
        log.append(slot)
        cap = max(MAX_WRITE_LOG, 2 * self.high)
        if len(log) > cap:                    # keep the newer half: a reader near the end
            drop = len(log) - cap // 2        # still reads only what it missed
            del log[:drop]
            self.log_base += drop

    def put(self, entry: tuple[tuple[float, ...], int, Request]) -> int:
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.high
            self.grow(slot + 1)
            self.high += 1
        (key, started, seq), counter, req = entry
        self.records[slot] = (counter, key, seq, req.arrival_time, req.priority,
                              len(req.prompt_token_ids), len(req.output_token_ids),
                              req.compile_ms, started, req.status, req.constraint)
        self.ids[slot] = req.request_id
        self._wrote(slot)
        return slot

    def rekey(self, slot: int, key: tuple[float, ...]) -> None:
        self.cols["key"][slot], self.cols["started"][slot], self.cols["seq"][slot] = key
        self._wrote(slot)

    def clear(self, slot: int) -> None:
        self.cols["counter"][slot] = 0
        self.ids[slot] = None
        self.free.append(slot)
        self._wrote(slot)

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


class WaitingQueue:
    def __init__(self, policy: str = "fcfs", hybrid_aging_s: float = 5.0) -> None:
        self.policy = policy
        self.hybrid_aging_s = hybrid_aging_s
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}
        self._timeouts: list[tuple[float, int, Request]] = []
        self._enqueued_at: dict[str, float] = {}
        self._counter = 0  # makes heap entries unique, so requests are never compared
        self._removed: list[str] = []   # ids that left, in order (`removed_since`)
        self._stays = StayColumns()
        self._slot: dict[str, int] = {}  # id -> its slot in `_stays`
        self._removed_base = 0          # how many were dropped from the front of that log
        self.order_changes = 0          # policy changes (every stay re-keyed)

    # --- keys ---------------------------------------------------------------------------------
    def class_key(self, req: Request) -> float:
        """The policy's notion of urgency, without tie-breaks (lower = more urgent)."""
        if self.policy == "priority":
            return float(req.priority)
        if self.policy == "hybrid":
            return req.priority + req.arrival_time / self.hybrid_aging_s
        return 0.0

    def rank(self, req: Request) -> tuple[float, int]:
        """Total order of requests under the policy, ignoring preemption (lower = better).
        The scheduler's preemption victim is the running request with the largest rank."""
        return self.class_key(req), req.seq_no

    def _key(self, req: Request) -> _Key:
        started = 0 if req.status == RequestStatus.PREEMPTED else 1
        return self.class_key(req), started, req.seq_no

    # --- membership ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def add(self, req: Request, now: float) -> None:
        """Enqueue a request. A new one (status WAITING) also enters the timeout heap."""
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        self._counter += 1
        entry = (self._key(req), self._counter, req)
        self._live[req.request_id] = entry
        self._slot[req.request_id] = self._stays.put(entry)
        heapq.heappush(self._heap, entry)
        if req.status == RequestStatus.WAITING:
            self._enqueued_at[req.request_id] = now
            heapq.heappush(self._timeouts, (now, self._counter, req))

    def _prune(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2].request_id) is not heap[0]:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._prune()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._prune()
        if not self._heap:
            raise IndexError("pop from an empty waiting queue")
        req = heapq.heappop(self._heap)[2]
        self._forget(req.request_id)
        return req

    def remove(self, request_id: str) -> bool:
        """Take a request out (lazily: its heap entries become stale). False if absent."""
        if request_id not in self._live:
            return False
        self._forget(request_id)
        self._maybe_compact()
        return True

    def _forget(self, request_id: str) -> None:
        del self._live[request_id]
        self._stays.clear(self._slot.pop(request_id))
        self._removed.append(request_id)
        if len(self._removed) > MAX_REMOVED_LOG:
            self._removed_base += len(self._removed)
            self._removed = []
        self._enqueued_at.pop(request_id, None)

    def _maybe_compact(self) -> None:
        if (len(self._heap) > 2 * len(self._live) + 64
                or len(self._timeouts) > 2 * len(self._enqueued_at) + 64):
            self._rebuild()

    # --- policy and timeouts ------------------------------------------------------------------
    def set_policy(self, policy: str, hybrid_aging_s: float) -> None:
        """Hot policy change: re-key every waiting request once, O(n log n)."""
        if policy == self.policy and hybrid_aging_s == self.hybrid_aging_s:
            return
        self.policy, self.hybrid_aging_s = policy, hybrid_aging_s
        self.order_changes += 1
        self._rebuild()

    def _rebuild(self) -> None:
        live: dict[str, _Entry] = {}
        for rid, (old, n, req) in self._live.items():
            key = self._key(req)
            if key != old:
                self._stays.rekey(self._slot[rid], key)
            live[rid] = (key, n, req)
        self._live = live
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
        self._timeouts = [(self._enqueued_at[rid], n, req)
                          for rid, (_, n, req) in self._live.items() if rid in self._enqueued_at]
        heapq.heapify(self._timeouts)

    def _is_live_timeout(self, t: float, req: Request) -> bool:
        entry = self._live.get(req.request_id)
        return entry is not None and entry[2] is req and self._enqueued_at.get(req.request_id) == t

    def pop_expired(self, deadline: float | None) -> list[Request]:
        """Remove and return the never-started requests enqueued before ``deadline`` (None:
        nothing expires, but stale entries at the top are still dropped)."""
        out: list[Request] = []
        heap = self._timeouts
        while heap:
            t, _, req = heap[0]
            if not self._is_live_timeout(t, req):
                heapq.heappop(heap)  # admitted or aborted since
            elif deadline is not None and t < deadline:
                heapq.heappop(heap)
                self._forget(req.request_id)
                out.append(req)
            else:
                break
        self._maybe_compact()
        return out

    def enqueue_time(self, request_id: str) -> float | None:
        return self._enqueued_at.get(request_id)

    # --- views --------------------------------------------------------------------------------
    def ordered(self, limit: int | None = None) -> list[Request]:
        """Waiting requests in scheduling order, the first ``limit`` of them: for iteration,
        tests and tools, not for the per-step path (telemetry reads `row_order` / `rows`).

        Sorts the heap list in place (a sorted list is a valid heap) and reads it front to
        back, skipping stale entries. Between two calls only a few entries moved, and Timsort
        finds the runs: close to O(n) comparisons, all in C."""
        heap, live = self._heap, self._live
        heap.sort()
        if limit is None:
            limit = len(live)
        out: list[Request] = []
        if limit <= 0:
            return out
        append = out.append
        for entry in heap:
            req = entry[2]
            if live.get(req.request_id) is entry:
                append(req)
                if len(out) >= limit:
                    break
        return out

    def row_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stay now in the queue, in scheduling order, as (slots, counters): the order
        `ordered` gives (heap key, then insertion), sorted by numpy over the slot arrays."""
        return self._stays.row_order()

    def rows(self, slots: np.ndarray, counters: np.ndarray) -> dict[str, Any]:
        """The rows of those stays (from `row_order`) still in the queue, in the given order:
        ``id`` a list, the other columns arrays (``arrival`` the arrival times)."""
        return self._stays.rows(slots, counters)

    def changes_since(self, since: int) -> tuple[list[int], np.ndarray, list[Any], int, int]:
        """The slots written after write number ``since`` (added, re-keyed, removed: 0 for
        all), their records and ids as they are now, the number to pass next time and the
        slots in use. O(writes since) from the write log; O(slots) when it no longer reaches
        back (`vconsole.engine.sched.queue_mirror`)."""
        st = self._stays
        slots = st.written_since(since)
        ids = st.ids
        return slots, st.records[slots], [ids[i] for i in slots], st.changes, st.high

    def removed_since(self, mark: int) -> tuple[list[str] | None, int]:
        """Ids that left the queue (admitted, aborted, expired) since ``mark``, and the mark to
        pass next time (0 at first). None when the log no longer reaches back that far."""
        end = self._removed_base + len(self._removed)
        if mark < self._removed_base:
            return None, end
        return self._removed[mark - self._removed_base:], end

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())
