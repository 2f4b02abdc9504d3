"""The hand-off's wire form: what the busy loop sends its publisher process, as ZeroMQ frames.

Why a form of its own: the busy loop must pay no more than a pack and a non-blocking send, and
the publisher process must rebuild exactly the objects an in-process `Inbox` would have been
handed.

The hot two kinds (a snapshot, steps on their own) are msgpack: the dataclasses as tuples of
their fields (`attrgetter`, no per-object reduce), every column's bytes in one blob
(`pack_columns`). Pickling them — two dozen small arrays, five dataclasses — cost the busy loop
~300 µs a snapshot right after a forward, when nothing is in the cache.

The request table's 10,000 waiting rows do not cross at all: the publisher process keeps a
mirror of the waiting queue and joins them there (`vconsole.engine.publish.queue_mirror`). A
snapshot's table (`QueueRows`) crosses as its running rows and what changed in the queue since
the last snapshot the process got; `decode` applies that to the process's mirror
(`MirroredTable`) and joins the table the engine's own cached rows would have made.

Frames: a snapshot is one frame, msgpack ``["snap", steps, lost, body]``, steps on their own
``["steps", steps, lost]`` (one frame: each frame is a send of its own); the rare ones
``[kind, pickle]``. Only our own two processes speak it, over an ``ipc://`` socket in a folder
only this user can open, so pickle is safe here; it is never a public wire.

Invariant: `decode` of `snapshot_frames` / `steps_frames` gives the same `SchedulerStats`,
`KVStats` and step records (field for field, the same column dtypes; records as lists) that
were packed — a `QueueRows` table as the table the engine's own `WaitingRows` would have made,
joined from the process's mirror.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import msgpack
import numpy as np

from vconsole.engine.publish.queue_mirror import MirroredTable, QueueRows, SyncSender, pack_rows
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
STEPS = b"steps"
CALL = b"call"      # a rare hand-off: (method name, args), applied to the Inbox as it is
STOP = b"stop"
# Kinds, publisher process -> engine.
READY = b"ready"
FAILED = b"failed"
CLOSED = b"closed"
RESYNC = b"resync"  # the mirror of the waiting queue lost step: send the whole queue

# What a step record carries across: the fields the ``step`` topic aggregates, the end of the
# step (`StepStats.start_ns` + ``total_ns``, monotonic: one clock for both processes) and the
# batch's shape the MFU counters read (`vconsole.engine.publish.mfu`).
STEP_FIELDS = ("schedule_ns", "execute_ns", "update_ns", "total_ns", "num_prefill_tokens",
               "num_decode_tokens", "num_reqs", "num_preempted", "num_finished",
               "structured_ns", "start_ns", "num_context_tokens", "prefill_attention",
               "num_prefill_reqs", "prefill_context_tokens")
_step_tuple = attrgetter(*STEP_FIELDS)

StepRecord = tuple[int, ...]      # STEP_FIELDS, in order


def step_records(steps: Sequence[StepStats]) -> list[StepRecord]:
    return [_step_tuple(s) for s in steps]


def step_stats(record: Sequence[int]) -> tuple[StepStats, float | None]:
    """The `StepStats` a record came from (the fields the publisher reads) and when the step
    ended (monotonic seconds; None when the core did not stamp it)."""
    fields: dict[str, Any] = dict(zip(STEP_FIELDS, record, strict=True))
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
    steps: Steps | None      # since the last hand-off (a snapshot refused loses them: counted)


_SCHED_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats) if f.name != "requests")
_KV_FIELDS = tuple(f.name for f in dataclasses.fields(KVStats)
                   if f.name not in ("block_states", "block_age_s"))
_sched_values = attrgetter(*_SCHED_FIELDS)
_kv_values = attrgetter(*_KV_FIELDS)


def _plain(value: Any) -> Any:
    """msgpack's fallback: a numpy scalar as its Python value."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot pack {type(value).__name__}")


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, default=_plain, use_bin_type=True,
                         unicode_errors="surrogatepass")


def _unpackb(data: Any) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False,
                           unicode_errors="surrogatepass")


def pack_columns(cols: dict[str, Any]) -> list[Any]:
    """Columns as ``[names, dtypes, blob, others]``: every 1-D numpy array's bytes joined in
    one blob (with its dtype; None for a value that goes as it is: the ids' list)."""
    names, dtypes, parts, others = [], [], [], []
    for name, v in cols.items():
        names.append(name)
        if isinstance(v, np.ndarray) and v.dtype != object and v.ndim == 1:
            dtypes.append(v.dtype.str)
            parts.append(v.tobytes())
        else:
            dtypes.append(None)
            others.append(v.tolist() if isinstance(v, np.ndarray) else v)
    return [names, dtypes, b"".join(parts), others]


def unpack_columns(packed: Sequence[Any], length: int) -> dict[str, Any]:
    """`pack_columns`'s columns, each array ``length`` long (read-only views of the blob)."""
    names, dtypes, blob, others = packed
    out: dict[str, Any] = {}
    offset, rest = 0, iter(others)
    for name, dtype in zip(names, dtypes, strict=True):
        if dtype is None:
            out[name] = next(rest)
            continue
        dt = np.dtype(dtype)
        out[name] = np.frombuffer(blob, dt, length, offset)
        offset += dt.itemsize * length
    return out


def _pack_requests(rows: Any, queue: SyncSender | None) -> list[Any]:
    if isinstance(rows, RequestTable) and isinstance(rows.parts, QueueRows):
        return ["mirror", pack_rows(rows.parts, queue if queue is not None else SyncSender())]
    if rows and not isinstance(rows, RequestTable):
        rows = as_table(rows)
    if isinstance(rows, RequestTable):
        return ["table", len(rows), pack_columns(rows.columns)]
    return ["none"]


def _unpack_requests(packed: list[Any], table: MirroredTable | None) -> Any:
    kind = packed[0]
    if kind == "mirror":
        return (table if table is not None else MirroredTable()).unpack(packed[1])
    if kind == "table":
        return RequestTable(unpack_columns(packed[2], packed[1]))
    return []


def snapshot_frames(snap: Snapshot, queue: SyncSender | None = None) -> list[bytes]:
    """Frames for one snapshot: one, msgpack with its steps (a pickle of these
    dataclasses and two dozen small arrays cost the busy loop ~300 µs). A `QueueRows` table
    goes as its running rows and what changed in the queue (``queue``: how far the process's
    mirror is; None: all of it); a list of rows as a table's columns."""
    sched, kv = snap.sched, snap.kv
    states = np.ascontiguousarray(kv.block_states)
    ages = None if kv.block_age_s is None else \
        np.ascontiguousarray(kv.block_age_s, np.float32).tobytes()
    body = [snap.state, snap.num_steps, snap.wall, snap.text, _sched_values(sched),
            _pack_requests(sched.requests, queue), _kv_values(kv), states.dtype.str,
            len(states), states.tobytes(), ages]
    steps = snap.steps if snap.steps is not None else Steps([])
    return [_packb(["snap", steps.records, steps.lost, body])]


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
    return [_packb(["steps", steps.records, steps.lost])]


def call_frames(method: str, *args: Any) -> list[Any]:
    return [CALL, pickle.dumps((method, args), protocol=5)]


def message_frames(kind: bytes, body: Any = None) -> list[Any]:
    return [kind, pickle.dumps(body, protocol=5)]


def decode(frames: Sequence[Any], table: MirroredTable | None = None) -> tuple[bytes, Any]:
    """``(kind, body)``: a `Snapshot`, `Steps`, ``(method, args)`` or a message's body. A
    snapshot's queue changes are applied to ``table`` (the process's mirror: a fresh one when
    None) and its table joined there; a snapshot whose changes do not apply (`MirroredTable
    .apply`) comes back as its `Steps` only."""
    if len(frames) > 1:
        return bytes(frames[0]), pickle.loads(frames[1])
    name, records, lost, *body = _unpackb(frames[0])
    steps = Steps(records, lost)
    if name == "steps":
        return STEPS, steps
    (state, num_steps, wall, text, sched_values, requests, kv_values, dtype, n,
     states, ages) = body[0]
    rows = _unpack_requests(requests, table)
    if rows is None:
        return STEPS, steps
    sched = SchedulerStats(**dict(zip(_SCHED_FIELDS, sched_values, strict=True)),
                           requests=rows)
    kv = KVStats(**dict(zip(_KV_FIELDS, kv_values, strict=True)),
                 block_states=np.frombuffer(states, np.dtype(dtype), n),
                 block_age_s=None if ages is None else np.frombuffer(ages, np.float32, n))
    return SNAPSHOT, Snapshot(sched, kv, state, num_steps, wall, text, steps)
