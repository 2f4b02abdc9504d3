"""Liveness: how the supervisor tells a hung engine from a busy one.

A child that is alive but stopped stepping while it has work (a deadlocked collective, a
kernel that never returns, a process stopped by a signal) answers nobody and never dies, so
the supervisor would wait on it forever. The busy loop therefore stamps a small shared file
(``mmap``, 16 bytes: the time of its last pass on ``time.monotonic``'s clock, which Linux
shares between processes, and whether it had work then) on every pass, and the supervisor
reads it: work pending and no pass for longer than ``hang_timeout_s`` means hung, and the
child is killed and restarted with reason ``hung: no step for N s``.

The busy loop's cost is one ``struct.pack_into`` per pass (no system call). An idle engine
blocks on its input queue with ``busy`` stamped 0, so waiting for work is never a hang.

Invariant: the file is written by the child only and read by the supervisor only; a torn
read is harmless (the next poll reads it again).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_FORMAT = "<dQ"                 # last pass (monotonic seconds), busy flag
SIZE = struct.calcsize(_FORMAT)


def create(path: str | os.PathLike[str]) -> None:
    """The supervisor makes the file (zeros: never stamped) before it starts a child."""
    with open(path, "wb") as f:
        f.write(bytes(SIZE))


class LivenessStamp:
    """The child's side: `beat` on every pass of the busy loop."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)

    def beat(self, busy: bool) -> None:
        struct.pack_into(_FORMAT, self._map, 0, time.monotonic(), 1 if busy else 0)

    def close(self) -> None:
        self._map.close()


def read(path: str | os.PathLike[str]) -> tuple[float, bool] | None:
    """The supervisor's side: ``(last pass, busy)``, None before the first stamp."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    t, busy = struct.unpack_from(_FORMAT, data)
    return (t, bool(busy)) if t > 0 else None


def hung_for(path: str | os.PathLike[str], timeout_s: float,
             now: float | None = None) -> float | None:
    """Seconds since the child's last pass when it had work and that is over ``timeout_s``;
    None when it is not hung (idle, stepping, or never stamped)."""
    stamp = read(path)
    if stamp is None:
        return None
    t, busy = stamp
    age = (time.monotonic() if now is None else now) - t
    return age if busy and age > timeout_s else None
