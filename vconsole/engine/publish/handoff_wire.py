"""The hand-off's wire form: what the busy loop sends its publisher process, as ZeroMQ frames.

Why a form of its own: the busy loop must pay no more than a pack and a non-blocking send, and
the publisher process must rebuild exactly the objects an in-process `Inbox` would have been
handed. So the two hot messages are cheap to pack: a snapshot is one small pickle (the
scheduler and KV dataclasses without their big parts, the steps since the last one as plain
tuples) plus raw frames — every numpy column of the request table and the KV block map out of
band (pickle protocol 5 buffers: a memcpy each, no per-row Python), and the request ids as
what changed since the last snapshot (`handoff_ids`), or joined into one string. Everything else (config, latency, dp, wave, errors, state) is rare and small: a
pickle each.

Frames: ``[kind, pickle, *raw]``; a snapshot's are ``[kind, steps, head, *bulk]``, or with
shared slots (`handoff_ring`) ``[kind, steps, head, slot descriptor]`` with the bulk in the
slot. Only our own two processes speak it, over an ``ipc://`` socket in a folder only this user
can open, so pickle is safe here; it is never a public wire.

Invariant: `decode` of `snapshot_frames` / `steps_frames` gives the same `SchedulerStats`,
`KVStats` and step records (field for field, the same column dtypes) that were packed.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from vconsole.engine.publish.handoff_ids import IdsDecoder, IdsEncoder
from vconsole.engine.publish.handoff_ring import HandoffRing
from vconsole.shared.stats import (
    REQUEST_NUMERIC,
    REQUEST_STATES,
    KVStats,
    RequestRow,
    RequestTable,
    SchedulerStats,
    StepStats,
)

# Kinds, engine -> publisher process.
SNAPSHOT = b"snap"
SNAPSHOT_RING = b"snapr"    # its bulk in a shared slot
STEPS = b"steps"
CALL = b"call"      # a rare hand-off: (method name, args), applied to the Inbox as it is
STOP = b"stop"
# Kinds, publisher process -> engine.
READY = b"ready"
FAILED = b"failed"
CLOSED = b"closed"

# What a step record carries across: the fields the ``step`` topic aggregates and the end of
# the step (`StepStats.start_ns` + ``total_ns``, monotonic: one clock for both processes).
STEP_FIELDS = ("schedule_ns", "execute_ns", "update_ns", "total_ns", "num_prefill_tokens",
               "num_decode_tokens", "num_reqs", "num_preempted", "num_finished",
               "structured_ns", "start_ns")
_step_tuple = attrgetter(*STEP_FIELDS)

StepRecord = tuple[int, ...]      # STEP_FIELDS, in order


def step_records(steps: Sequence[StepStats]) -> list[StepRecord]:
    return [_step_tuple(s) for s in steps]


def step_stats(record: Sequence[int]) -> tuple[StepStats, float | None]:
    """The `StepStats` a record came from (the fields the publisher reads) and when the step
    ended (monotonic seconds; None when the core did not stamp it)."""
    fields = dict(zip(STEP_FIELDS, record, strict=True))
    start = fields["start_ns"]
    end = (start + fields["total_ns"]) / 1e9 if start else None
    return StepStats(**fields), end


@dataclasses.dataclass
class Steps:
    """Step records since the last hand-off; ``lost``: steps the engine recorded that never
    crossed (a hand-off refused at the high-water mark), counted since start."""

    records: list[StepRecord]
    lost: int = 0


@dataclasses.dataclass
class Snapshot:
    sched: SchedulerStats
    kv: KVStats
    state: str
    num_steps: int
    wall: float
    text: dict[str, list[str]] | None
    steps: Steps | None      # crosses in its own frame: a snapshot dropped keeps its steps


def snapshot_frames(snap: Snapshot, ring: HandoffRing | None = None,
                    ids: IdsEncoder | None = None) -> list[Any]:
    """Frames for one snapshot, its bulk in ``ring`` when it fits, its ids through ``ids``
    (None: whole). Replaces a list of rows by a `RequestTable` (objects handed to the
    publisher belong to it)."""
    steps, snap.steps = snap.steps, None
    sched = snap.sched
    if not isinstance(sched.requests, RequestTable) and sched.requests:
        sched.requests = as_table(sched.requests)
    rows = sched.requests
    ids_frame = b""
    if isinstance(rows, RequestTable):
        encoder = ids if ids is not None else IdsEncoder()
        ids_frame = pickle.dumps(encoder.encode(rows.columns["id"]), protocol=5)
        sched.requests = RequestTable({**rows.columns, "id": None})
    raw: list[Any] = []
    head = pickle.dumps(snap, protocol=5, buffer_callback=raw.append)
    sched.requests = rows    # as it was: the caller may still read it
    snap.steps = steps
    steps_frame = pickle.dumps(steps, protocol=5)
    bulk = [ids_frame, *(b.raw() for b in raw)]
    if ring is not None:
        desc = ring.put(bulk)
        if desc is not None:
            return [SNAPSHOT_RING, steps_frame, head, pickle.dumps(desc, protocol=5)]
    return [SNAPSHOT, steps_frame, head, *bulk]


_STATE_CODES = {name: code for code, name in enumerate(REQUEST_STATES)}


def as_table(rows: Sequence[RequestRow]) -> RequestTable:
    """Request rows as the columns the scheduler's own table has (what a stand-in core or a
    test hands over: a column per field costs less to cross than a pickled object per row)."""
    n = len(rows)
    cols: dict[str, Any] = {
        "id": [r.id for r in rows],
        "state": np.fromiter((_STATE_CODES[r.state] for r in rows), np.uint8, n)}
    for name, dtype in REQUEST_NUMERIC.items():
        cols[name] = np.array([getattr(r, name) for r in rows], dtype=dtype)
    return RequestTable(cols)


def steps_frames(steps: Steps) -> list[Any]:
    return [STEPS, pickle.dumps(steps, protocol=5)]


def call_frames(method: str, *args: Any) -> list[Any]:
    return [CALL, pickle.dumps((method, args), protocol=5)]


def message_frames(kind: bytes, body: Any = None) -> list[Any]:
    return [kind, pickle.dumps(body, protocol=5)]


def decode(frames: Sequence[Any], ring: HandoffRing | None = None,
           ids: IdsDecoder | None = None) -> tuple[bytes, Any]:
    """``(kind, body)``: a `Snapshot`, `Steps`, ``(method, args)`` or a message's body. A
    snapshot whose slot was overwritten before it was read, or whose ids are a delta on a
    list ``ids`` does not hold, comes back as its `Steps` only."""
    kind = bytes(frames[0])
    if kind not in (SNAPSHOT, SNAPSHOT_RING):
        return kind, pickle.loads(frames[1]) if len(frames) > 1 else None
    steps: Steps = pickle.loads(frames[1])
    bulk: Sequence[Any] | None = frames[3:]
    if kind == SNAPSHOT_RING:
        bulk = ring.take(pickle.loads(frames[3])) if ring is not None else None
        if bulk is None:
            return STEPS, steps
    assert bulk is not None
    snap: Snapshot = pickle.loads(frames[2], buffers=bulk[1:])
    snap.steps = steps
    if len(bulk[0]):
        names = (ids if ids is not None else IdsDecoder()).decode(pickle.loads(bulk[0]))
        if names is None:
            return STEPS, steps
        table = snap.sched.requests
        assert isinstance(table, RequestTable)
        table.columns["id"] = names
    return SNAPSHOT, snap
