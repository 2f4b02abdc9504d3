"""The request table's ids across the hand-off, as what changed since the last snapshot.

Why: joining 10,000 id strings reads every string object, and right after a forward none of
them is in the cache — ~0.5 ms of the busy loop per snapshot, the largest part of the hand-off.
But from one snapshot to the next the table's ids are mostly the *same objects*: the waiting
rows are the scheduler's cached list (`vconsole.engine.sched.request_rows`), shifted by the
requests admitted. So the busy loop compares the two lists' pointer arrays (numpy over the
lists' own item arrays, read through ctypes: no string is touched, no reference taken) and
sends the one shared run as (start in the previous list, length) and only the ids around it as
strings. Pointer equality is identity: the previous list is held here, so its strings are
alive and no new string can have one of their addresses.

`IdsEncoder` (engine) and `IdsDecoder` (publisher process) number the lists they agree on
(``gen``). A delta names its base; a decoder that does not hold that base (a snapshot lost to a
full queue or an overwritten slot, a restarted process) drops the snapshot, and the encoder
sends the whole list again every `FULL_EVERY` snapshots and after any send it knows failed.
Where CPython's list layout is not the one checked at import (`_layout_ok`), every list goes
whole.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

SEP = "\0"
FULL_EVERY = 10           # snapshots: a decoder that lost its base recovers within a second
MIN_SHARED = 0.5          # of the list: below this the whole list goes

_OB_ITEM = 3 * ctypes.sizeof(ctypes.c_void_p)    # PyListObject: refcnt, type, size, ob_item

Code = tuple[Any, ...]


def _pointers(items: list[Any]) -> np.ndarray:
    """A view of ``items``'s item array (the object addresses), valid while it is unchanged."""
    n = len(items)
    if not n:
        return np.empty(0, np.uintp)
    base = ctypes.c_void_p.from_address(id(items) + _OB_ITEM).value
    if not base:
        raise ValueError("a list without its item array")
    return np.ctypeslib.as_array((ctypes.c_size_t * n).from_address(base))


def _layout_ok() -> bool:
    if sys.implementation.name != "cpython":
        return False
    probe = [object(), object(), object()]
    try:
        return _pointers(probe).tolist() == [id(x) for x in probe]
    except (ValueError, TypeError, OSError):
        return False


LAYOUT_OK = _layout_ok()


def _join(ids: list[str]) -> bytes | list[str]:
    """One string's bytes when no id holds the separator; the list itself otherwise."""
    joined = SEP.join(ids)
    if len(ids) > 1 and joined.count(SEP) != len(ids) - 1:
        return ids
    return joined.encode("utf-8", "surrogatepass")


def _split(blob: bytes | list[str], n: int) -> list[str]:
    if isinstance(blob, list):
        return blob
    return blob.decode("utf-8", "surrogatepass").split(SEP) if n else []


class IdsEncoder:
    """The engine's side: `encode` each snapshot's id list; `reset` after a failed send."""

    def __init__(self) -> None:
        self.gen = 0
        self._prev: list[str] | None = None
        self._since_full = 0

    def reset(self) -> None:
        self._prev = None

    def encode(self, ids: list[str]) -> Code:
        self.gen += 1
        prev, self._prev = self._prev, ids
        code = None
        if prev is not None and LAYOUT_OK and self._since_full < FULL_EVERY:
            code = self._delta(prev, ids)
        if code is None:
            self._since_full = 0
            return ("full", self.gen, len(ids), _join(ids))
        self._since_full += 1
        return code

    def _delta(self, prev: list[str], ids: list[str]) -> Code | None:
        n = len(ids)
        if n < 64 or len(prev) < 64:
            return None
        cur_p, prev_p = _pointers(ids), _pointers(prev)
        mid = n // 2
        where = np.flatnonzero(prev_p == cur_p[mid])
        if not len(where):
            return None
        shift = int(where[0]) - mid                # prev index = cur index + shift
        lo, hi = max(0, -shift), min(n, len(prev) - shift)
        differ = np.flatnonzero(cur_p[lo:hi] != prev_p[lo + shift:hi + shift]) + lo
        before, after = differ[differ < mid], differ[differ > mid]
        start = int(before[-1]) + 1 if len(before) else lo
        end = int(after[0]) if len(after) else hi
        if end - start < MIN_SHARED * n:
            return None
        return ("delta", self.gen - 1, self.gen, n, start, _join(ids[:start]),
                start + shift, end - start, n - end, _join(ids[end:]))


class IdsDecoder:
    """The publisher process's side: the list of the last code it decoded."""

    def __init__(self) -> None:
        self.gen = -1
        self._prev: list[str] = []

    def decode(self, code: Code) -> list[str] | None:
        """The ids; None for a delta on a base this decoder does not hold."""
        if code[0] == "full":
            _, gen, n, blob = code
            ids = _split(blob, n)
        else:
            _, base, gen, n, n_head, head, start, count, n_tail, tail = code
            if base != self.gen:
                self.gen = -1                      # lost: wait for the next whole list
                return None
            ids = [*_split(head, n_head), *self._prev[start:start + count],
                   *_split(tail, n_tail)]
        if len(ids) != n:
            self.gen = -1
            return None
        self.gen, self._prev = gen, ids
        return ids
