"""The waiting queue's rows, kept in step in the publisher process.

Why: the ``sched`` table lists up to 10,000 waiting requests ten times a second. Built in the
engine process, even from cached rows (`vconsole.engine.publish.request_rows.WaitingRows`), it
cost the busy loop a refresh of the rows every second and a copy of them to the publisher
process — about 1% of its time at 10,000 rows. Instead the publisher process keeps a copy of
the queue's stay columns (`QueueMirror`) and runs the same `WaitingRows` over it, so the busy
loop pays only for what changed in the queue since the last snapshot.

How: the queue's log (`vconsole.engine.publish.queue_log.QueueLog`, the engine's
`WaitingQueue` tells it of every change) numbers every write to its stay columns (an ``add``, a
re-key, a removal: `QueueLog.changes_since`). At each snapshot `SyncSender` packs a `QueueSync` —
the slots written since the last sync the process got, with their columns as they are now; the
ids that left the queue since (its removal log); the queue's length and policy count — and
`MirroredTable.apply` writes it into the mirror. The sender advances only when told the send
went (`sent`); a refused send leaves it where it was, so the next sync carries a superset, and
a process that restarted, or a new log (`RequestRows.reset`), gets everything (`reset`). A sync marked ``full`` (the first, after a
reset, or when the removal log no longer reaches back) makes the mirror and its cached rows
start over. A policy change re-keys every stay (all slots go) and the cached rows re-read the
order, as `RequestRows` makes the engine's own. Each sync names the write number it
starts from (``base``) and the one it brings the mirror to: the mirror applies only the sync
that starts where it stands; one that does not (lost on the way, a hand-off that failed half
applied) is refused, and the publisher process asks the engine for the whole queue
(``resync``, `vconsole.engine.publish.publisher_child`).

Invariant: after `apply` of every sync in order, the mirror's live slots, their columns and its
removal log (from the first full sync on) equal the queue's, so `MirroredTable.table` is the
table `WaitingRows.table` would have made in the engine with the same refresh timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vconsole.engine.publish.queue_log import STAY_DTYPE, QueueLog, RemovalLog, StayColumns
from vconsole.engine.publish.request_rows import REFRESH_S, QueueRows, WaitingRows, head_columns
from vconsole.shared.stats import RequestTable

__all__ = ["MirroredTable", "QueueMirror", "QueueRows", "QueueSync", "SyncSender", "pack_rows"]


@dataclass
class QueueSync:
    """What changed in a queue since the last sync: ``slots`` and their records now
    (`STAY_DTYPE`) and ids (None for a freed slot), the ids that left since (in order), its
    length, its policy changes so far, and its slots in use. ``base``: the write number it
    starts from (the last sync the mirror acknowledged; None when ``full``), ``changes`` the one
    it brings the mirror to: a mirror applies only the sync that starts where it stands."""

    full: bool
    base: int | None
    changes: int
    slots: list[int]
    records: np.ndarray
    ids: list[Any]
    removed: list[str]
    num_live: int
    order_changes: int
    high: int


class SyncSender:
    """The engine's side, one per publisher process: how far the process's mirror is, of
    which log (a sync of another log than the last one sent is full)."""

    def __init__(self) -> None:
        self._since: int | None = None       # write number the mirror has (None: nothing)
        self._mark = 0                       # the removal log, read up to here
        self._log: QueueLog | None = None    # the log those numbers are of
        self._pending: tuple[int, int, QueueLog] | None = None

    def reset(self) -> None:
        """The process holds nothing (it restarted): the next sync is full."""
        self._since, self._pending = None, None

    def sync(self, log: QueueLog) -> QueueSync:
        same = log is self._log and self._since is not None
        removed, mark = log.removed_since(self._mark)
        full = not same or removed is None
        base = None if full else self._since
        slots, records, ids, changes, high = log.changes_since(base or 0)
        self._pending = (changes, mark, log)
        return QueueSync(full, base, changes, slots, records, ids,
                         [] if full else list(removed or ()), len(log), log.order_changes,
                         high)

    def sent(self, ok: bool) -> None:
        """The last sync's send went (the mirror has it) or was refused (it has not)."""
        if ok and self._pending is not None:
            self._since, self._mark, self._log = self._pending
        self._pending = None


class QueueMirror:
    """A copy of a queue's stay columns and removal log: what `WaitingRows` reads of a queue
    (`request_rows.QueueView`)."""

    def __init__(self) -> None:
        self._stays = StayColumns()
        self._removals = RemovalLog()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def apply(self, sync: QueueSync) -> None:
        stays = self._stays
        stays.grow(sync.high)
        stays.high = max(stays.high, sync.high)
        stays.records[sync.slots] = sync.records
        stays.ids[sync.slots] = sync.ids
        self._removals.extend(sync.removed)          # bounded as the log's: readers rebuild
        self._len = sync.num_live

    def row_order(self) -> tuple[np.ndarray, np.ndarray]:
        return self._stays.row_order()

    def rows(self, slots: np.ndarray, counters: np.ndarray) -> dict[str, Any]:
        return self._stays.rows(slots, counters)

    def removed_since(self, mark: int) -> tuple[list[str] | None, int]:
        return self._removals.since(mark)


class MirroredTable:
    """The publisher process's side: the mirror and its cached rows."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self.mirror = QueueMirror()
        self.rows = WaitingRows(refresh_s)
        self._order_changes: int | None = None
        self._applied: int | None = None     # the write number the mirror stands at

    def reset(self) -> None:
        """Forget everything (a sync that failed half-applied): only a full one applies."""
        self.mirror, self.rows = QueueMirror(), WaitingRows(self.refresh_s)
        self._order_changes = self._applied = None

    @property
    def wants_full(self) -> bool:
        """Nothing applied yet (or since a reset): the engine must send a full sync."""
        return self._applied is None

    def apply(self, sync: QueueSync) -> bool:
        """Apply ``sync``; False (nothing applied) when it does not start where this mirror
        stands — a sync lost on the way, a fresh mirror: the engine must send a full one."""
        if sync.full:
            self.mirror, self.rows = QueueMirror(), WaitingRows(self.refresh_s)
        elif self._applied is None or sync.base != self._applied:
            return False
        elif sync.order_changes != self._order_changes:
            self.rows.invalidate()
        self._order_changes = sync.order_changes
        self.mirror.apply(sync)
        self._applied = sync.changes
        return True

    def table(self, head: dict[str, Any], max_waiting: int, now: float) -> RequestTable:
        return self.rows.joined(head, self.mirror, max_waiting, now)

    def unpack(self, packed: list[Any]) -> RequestTable | None:
        """The table `pack_rows` packed: its queue changes applied here, then joined; None
        when they do not apply (`apply`)."""
        head_ids, flat, max_waiting, now, sync = packed
        full, base, changes, slots, records, ids, removed, num_live, order_changes, high = sync
        if not self.apply(QueueSync(full, base, changes, slots,
                                    np.frombuffer(records, STAY_DTYPE, len(slots)), ids, removed,
                                    num_live, order_changes, high)):
            return None
        return self.table(head_columns((head_ids, flat), now), max_waiting, now)


def pack_rows(rows: QueueRows, sender: SyncSender) -> list[Any]:
    """A `QueueRows` table as plain values (msgpack: lists, numbers, bytes): its head rows, how
    many waiting rows and when, and the queue's changes since ``sender``'s last sync."""
    sync = sender.sync(rows.log)
    return [rows.head[0], rows.head[1], rows.max_waiting, rows.now,
            [sync.full, sync.base, sync.changes, sync.slots, sync.records.tobytes(), sync.ids,
             sync.removed, sync.num_live, sync.order_changes, sync.high]]
