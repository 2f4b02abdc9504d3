"""Shared slots for the snapshot's bulk (the request table's columns and ids, the KV block
map): the busy loop copies them into memory its publisher process maps too, and only a few
bytes (which slot, which generation, how long each buffer is) cross the socket.

Why: a ZeroMQ send of ~400 KB of frames costs the busy loop an allocation and a copy per
frame, and ZeroMQ's I/O thread another copy into the kernel, on a machine where every core is
the busy loop's competition; one ``memcpy`` into memory mapped once is a tenth of it.

The slots are an anonymous file (``memfd_create``: no path, so nothing is left behind when the
engine is killed) that the child inherits as a file descriptor. Slot ``seq % slots`` takes
snapshot ``seq``; its first 8 bytes hold the generation: -1 while the engine writes it, then
``seq``. The child copies a slot out and checks the generation before and after (a seqlock):
a slot the engine overwrote meanwhile (the child fell ``slots`` snapshots behind) is dropped,
never read torn.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

SLOTS = 4
SLOT_BYTES = 2 << 20          # a 10,000-row table is ~0.4 MB; larger snapshots use the socket
_HEADER = 8

Descriptor = tuple[int, int, list[int]]    # slot, generation, buffer lengths


class HandoffRing:
    """``fd``: the shared file (created here when None: the engine's side)."""

    def __init__(self, fd: int | None = None, slots: int = SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        size = slots * slot_bytes
        if fd is None:
            fd = os.memfd_create("vconsole-telemetry-handoff", 0)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        self._view = memoryview(self._map)
        self._gens = [self._view[i * slot_bytes:i * slot_bytes + _HEADER].cast("q")
                      for i in range(slots)]
        self._seq = 0

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create")

    # --- the engine's side ----------------------------------------------------------------

    def put(self, buffers: Sequence[Any]) -> Descriptor | None:
        """Copy ``buffers`` into the next slot; None when they do not fit (send them)."""
        lengths = [memoryview(b).nbytes for b in buffers]
        if sum(lengths) > self.slot_bytes - _HEADER:
            return None
        seq = self._seq = self._seq + 1
        slot = seq % self.slots
        gen = self._gens[slot]
        gen[0] = -1
        view = self._view
        off = slot * self.slot_bytes + _HEADER
        for b, n in zip(buffers, lengths, strict=True):
            view[off:off + n] = memoryview(b).cast("B")
            off += n
        gen[0] = seq
        return slot, seq, lengths

    # --- the child's side -------------------------------------------------------------------

    def take(self, desc: Descriptor) -> list[bytes] | None:
        """The buffers of ``desc``, copied out; None when the slot was overwritten."""
        slot, seq, lengths = desc
        gen = self._gens[slot]
        if gen[0] != seq:
            return None
        view = self._view
        off = slot * self.slot_bytes + _HEADER
        out = []
        for n in lengths:
            out.append(bytes(view[off:off + n]))
            off += n
        return out if gen[0] == seq else None

    def close(self, close_fd: bool = True) -> None:
        for g in self._gens:
            g.release()
        self._view.release()
        self._map.close()
        if close_fd:
            os.close(self.fd)
