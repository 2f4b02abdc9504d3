"""Who wrote a control key file, and whether that engine still runs.

Next to its key file (`vconsole.security.control_key`) the engine writes an *owner record*,
``<key file>.owner``: one JSON object with its pid, the process's start time, the host, its
engine id, the control endpoint and a fingerprint of the key (`key_id`, never the key). The key
file keeps its documented one-line format; the record is what tells

- a new engine on the same endpoint whether the file it finds is stale (its engine is gone:
  replace it) or belongs to an engine that is still running (refuse to start: two engines on one
  control endpoint is a mistake), and
- a client whether the key it holds belongs to an engine that still exists, and which one.

Invariants: the record describes a key file only while its ``key_id`` matches that file's key
(`status` checks; a mismatch is a record from another start, never trusted). A process counts as
the owner only if its pid exists *and* started at the recorded time (within `START_SLACK_S`), so
a reused pid is not mistaken for the engine. On another host nothing can be told (``unknown``).
The engine writes the record before the key and removes it after, both atomically and mode 0600.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

OWNER_SUFFIX = ".owner"
START_SLACK_S = 1.0

RUNNING, GONE, UNKNOWN, UNRECORDED = "running", "gone", "unknown", "unrecorded"


def key_id(key: str) -> str:
    """A fingerprint that names a key without revealing it."""
    return hashlib.sha256(key.strip().lower().encode("ascii", "replace")).hexdigest()[:16]


def owner_path(control_key_file: str | os.PathLike[str]) -> Path:
    path = Path(control_key_file)
    return path.with_name(path.name + OWNER_SUFFIX)


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), None if there is no such process or it has
    exited and waits to be reaped (a zombie: killed, its files left behind)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.Error, OSError, ValueError):
        return None


@dataclass(frozen=True)
class KeyOwner:
    pid: int
    started: float
    host: str
    engine_id: str
    endpoint: str
    key_id: str

    @classmethod
    def for_this_process(cls, key: str, *, engine_id: str, endpoint: str) -> KeyOwner:
        pid = os.getpid()
        return cls(pid, process_started(pid) or 0.0, socket.gethostname(), engine_id, endpoint,
                   key_id(key))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: Any) -> KeyOwner | None:
        try:
            owner = cls(int(d["pid"]), float(d["started"]), str(d["host"]),
                        str(d["engine_id"]), str(d["endpoint"]), str(d["key_id"]))
        except (KeyError, TypeError, ValueError):
            return None
        return owner if owner.pid > 0 else None

    def liveness(self) -> str:
        """`RUNNING`, `GONE` (no such process, or a later one reusing the pid), or `UNKNOWN`
        (written on another host)."""
        if self.host != socket.gethostname():
            return UNKNOWN
        started = process_started(self.pid)
        if started is None or abs(started - self.started) > START_SLACK_S:
            return GONE
        return RUNNING

    def describe(self) -> str:
        return f"engine {self.engine_id} (pid {self.pid}" + (
            ")" if self.host == socket.gethostname() else f" on {self.host})")


def read_owner(control_key_file: str | os.PathLike[str]) -> KeyOwner | None:
    """The owner record next to ``control_key_file``; None if there is none or it is not a record."""
    try:
        data = json.loads(owner_path(control_key_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return KeyOwner.from_dict(data) if isinstance(data, dict) else None


@dataclass(frozen=True)
class KeyStatus:
    """What is known about the engine behind a key: ``state`` is `RUNNING`, `GONE`, `UNKNOWN`
    (another host) or `UNRECORDED` (no record for this key: an older engine, a copied file)."""

    state: str
    owner: KeyOwner | None = None

    def describe(self) -> str:
        if self.owner is None:
            return "engine unknown (no owner record)"
        text = self.owner.describe()
        return f"{text}, no longer running" if self.state == GONE else text


def status(control_key_file: str | os.PathLike[str], key: str) -> KeyStatus:
    """The state of the engine that wrote ``key`` to ``control_key_file``."""
    owner = read_owner(control_key_file)
    if owner is None or owner.key_id != key_id(key):
        return KeyStatus(UNRECORDED)
    return KeyStatus(owner.liveness(), owner)
