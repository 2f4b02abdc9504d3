"""The waiting queue's own cost: our heap (`WaitingQueue`) against the seed's time wheel.

The seed cut its scheduling cost by replacing a red-black tree with a time wheel: a fixed ring
of 512 slots, a request appended to slot ``(cursor + priority) % 512``, the cursor walking to the
next non-empty slot. `TimeWheel` is that structure with our queue's operations (add, peek, pop,
lazy remove), kept here only as the peer of the measurement:

* ``priority``: one slot per priority value, FIFO inside a slot: exactly our order for requests
  that never ran (a preempted one would need a second ring to go back to the front).
* ``hybrid``: the slot is the request's class key ``priority + arrival / aging`` rounded down,
  so order inside one aging period is arrival order, not the exact key: an approximation of our
  policy, in the wheel's favour.

`queue_bench` measures the steady state the scheduler bench runs at: N waiting, and per round one
request admitted (peek + pop) and one new one queued (add), as when a running request finishes
and a waiting one takes its seat. It reports microseconds per round for each structure.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from typing import Any

from vconsole.engine.request import Request
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.wire.sampling import SamplingParams

NUM_SLOTS = 512
PRIORITY_CLASSES = (0, 1, 2, 5)


class TimeWheel:
    """The seed's structure: a ring of FIFO slots and a cursor; removal is lazy, as ours."""

    def __init__(self, policy: str, hybrid_aging_s: float = 5.0) -> None:
        self.policy, self.aging = policy, hybrid_aging_s
        self.slots: list[deque[Request]] = [deque() for _ in range(NUM_SLOTS)]
        self.base: int | None = None   # the class key of slot ``cursor``
        self.cursor = 0
        self.live: dict[str, Request] = {}

    def _class(self, req: Request) -> int:
        if self.policy == "hybrid":
            return int(req.priority + req.arrival_time / self.aging)
        return req.priority

    def __len__(self) -> int:
        return len(self.live)

    def add(self, req: Request, now: float) -> None:
        key = self._class(req)
        base = self.base
        if base is None or key < base:
            self._rebase(key)
            base = key
        if key - base >= NUM_SLOTS:
            raise ValueError("class key beyond the wheel")
        self.slots[(self.cursor + key - base) % NUM_SLOTS].append(req)
        self.live[req.request_id] = req

    def _rebase(self, key: int) -> None:
        """Move the cursor back so that slot ``cursor`` is class ``key`` (rare: a more urgent
        class than any queued)."""
        if self.base is not None:
            self.cursor = (self.cursor - (self.base - key)) % NUM_SLOTS
        self.base = key

    def peek(self) -> Request | None:
        if not self.live:
            return None
        while True:
            slot = self.slots[self.cursor]
            while slot and self.live.get(slot[0].request_id) is not slot[0]:
                slot.popleft()  # removed since
            if slot:
                return slot[0]
            self.cursor = (self.cursor + 1) % NUM_SLOTS
            self.base += 1  # type: ignore[operator]

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty wheel")
        self.slots[self.cursor].popleft()
        del self.live[req.request_id]
        return req

    def remove(self, request_id: str) -> bool:
        return self.live.pop(request_id, None) is not None


def _requests(n: int, seed: int, t0: float) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"q{i}", [1], SamplingParams(), priority=rng.choice(PRIORITY_CLASSES),
                    arrival_time=t0 + i * 1e-4, seq_no=i + 1) for i in range(n)]


def _round_us(queue: Any, pending: list[Request], rounds: int) -> float:
    """Median microseconds of one admit (peek + pop) plus one add, over ``rounds``."""
    times = []
    it = iter(pending)
    for _ in range(rounds):
        req = next(it)
        t0 = time.perf_counter_ns()
        queue.peek()
        queue.pop()
        queue.add(req, 0.0)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def queue_bench(sizes: list[int], rounds: int = 2000) -> dict[str, Any]:
    """Per policy and size: µs per round for the heap and the wheel, measured alternately."""
    rows = []
    for policy in ("priority", "hybrid"):
        for n in sizes:
            reqs = _requests(n + 2 * rounds, seed=n, t0=1000.0)
            heap, wheel = WaitingQueue(policy, 5.0), TimeWheel(policy, 5.0)
            for r in reqs[:n]:
                heap.add(r, 0.0)
                wheel.add(r, 0.0)
            heap_us, wheel_us = [], []
            for k in range(4):   # alternate, so load elsewhere falls on both
                chunk = reqs[n + k * rounds // 2:n + (k + 1) * rounds // 2]
                heap_us.append(_round_us(heap, chunk, len(chunk)))
                wheel_us.append(_round_us(wheel, chunk, len(chunk)))
            h, w = statistics.median(heap_us), statistics.median(wheel_us)
            rows.append({"policy": policy, "num_waiting": n, "heap_us": round(h, 2),
                         "time_wheel_us": round(w, 2), "wheel_speedup": round(h / w, 2)})
    return {"ops": "peek + pop + add per round", "results": rows}
