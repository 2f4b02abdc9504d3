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

Nothing here is telemetry's: whoever wants to follow the queue (the publishing side keeps a
numbered log of it, `vconsole.engine.publish.queue_log`) attaches one `QueueListener`
(`listen`), told of every stay that begins (``added``), ends (``removed``: popped, removed or
expired) and of every new order (``reordered``). With none attached a write costs one attribute
test, no call; with one, one call per write.

A second heap, keyed by enqueue time, finds requests waiting longer than ``max_holding_seconds``
in O(expired * log n). Only requests that never ran time out; a preempted request is exempt (the
scheduler, not the client's patience, put it back in the queue).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Protocol

from vconsole.engine.request import Request, RequestStatus

Key = tuple[float, ...]               # (class key, 0 if preempted else 1, seq_no)
Entry = tuple[Key, int, Request]      # (policy key, insertion counter, request)


class QueueListener(Protocol):
    """What hears every change to a `WaitingQueue` (see the module docstring). Called on the
    busy loop from inside the queue's own operations, after the change: each call must be
    O(1) but ``reordered`` (O(waiting), once per policy change)."""

    def added(self, entry: Entry) -> None:
        """A stay began: ``(key, counter, request)`` is its heap entry (``counter`` unique per
        stay: a request preempted back to the queue begins a new stay)."""

    def removed(self, request_id: str) -> None:
        """The request's stay ended: admitted (popped), removed or expired."""

    def reordered(self, changed: list[tuple[str, Key]]) -> None:
        """The order changed (a new policy): the waiting requests whose key changed, and their
        keys now."""


class WaitingQueue:
    def __init__(self, policy: str = "fcfs", hybrid_aging_s: float = 5.0) -> None:
        self.policy = policy
        self.hybrid_aging_s = hybrid_aging_s
        self._heap: list[Entry] = []
        self._live: dict[str, Entry] = {}
        self._timeouts: list[tuple[float, int, Request]] = []
        self._enqueued_at: dict[str, float] = {}
        self._counter = 0  # makes heap entries unique, so requests are never compared
        self.listener: QueueListener | None = None

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

    def _key(self, req: Request) -> Key:
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
        heapq.heappush(self._heap, entry)
        if req.status == RequestStatus.WAITING:
            self._enqueued_at[req.request_id] = now
            heapq.heappush(self._timeouts, (now, self._counter, req))
        listener = self.listener
        if listener is not None:
            listener.added(entry)

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
        self._enqueued_at.pop(request_id, None)
        listener = self.listener
        if listener is not None:
            listener.removed(request_id)

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
        self._rebuild(reorder=True)

    def _rebuild(self, reorder: bool = False) -> None:
        """Re-key every entry and drop the stale ones; the listener hears of a new order
        (``reorder``: a new policy) or of keys that changed."""
        live: dict[str, Entry] = {}
        changed: list[tuple[str, Key]] = []
        for rid, (old, n, req) in self._live.items():
            key = self._key(req)
            if key != old:
                changed.append((rid, key))
            live[rid] = (key, n, req)
        self._live = live
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
        self._timeouts = [(self._enqueued_at[rid], n, req)
                          for rid, (_, n, req) in self._live.items() if rid in self._enqueued_at]
        heapq.heapify(self._timeouts)
        if self.listener is not None and (reorder or changed):
            self.listener.reordered(changed)

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
        tests and tools, not for the per-step path (telemetry keeps its own rows: `listen`).

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

    def listen(self, listener: QueueListener | None) -> None:
        """Attach ``listener`` (None: detach): it replaces any other, and first hears an
        ``added`` for every request waiting now, so it follows the queue from here on."""
        self.listener = listener
        if listener is not None:
            for entry in self._live.values():
                listener.added(entry)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())
