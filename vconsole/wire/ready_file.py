"""The ready file: how a launcher learns where an engine listens, without reading its log.

``vconsole engine --ready-file PATH`` writes one JSON object to PATH once every socket is bound,
the control key file is written and the I/O threads run: the endpoints it actually bound (a
``tcp://127.0.0.1:*`` request resolved to its port), the control key file's path, its pid and
engine id. Launchers (`vconsole.engine.launch.engine_process.EngineProcess`, the tests, a
supervisor) poll for the file instead of matching log lines, so rewording a log line cannot
break them.

Invariants: the file is written atomically (a temporary file in the same folder, flushed, then
``os.replace``), so a reader sees nothing or the whole record, never half of one. The engine
removes it on a clean shutdown; a reader checks ``pid`` against the process it started, so a
file left by an engine that was killed is never mistaken for a new one. ``v`` is the record's
version; a reader refuses any other.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from vconsole.security.engine_key import write_private

READY_FILE_VERSION = 1
ENDPOINT_NAMES = ("input", "output", "telemetry", "control")


class ReadyFileError(ValueError):
    """The file exists but is not a ready record this reader understands."""


def ready_record(*, engine_id: str, pid: int, endpoints: dict[str, str],
                 control_key_file: str | os.PathLike[str], **extra: Any) -> dict[str, Any]:
    missing = [n for n in ENDPOINT_NAMES if n not in endpoints]
    if missing:
        raise ValueError(f"ready record without endpoint(s): {', '.join(missing)}")
    return {"v": READY_FILE_VERSION, "engine_id": engine_id, "pid": pid,
            "endpoints": {n: endpoints[n] for n in ENDPOINT_NAMES},
            "control_key_file": str(control_key_file), **extra}


def write_ready_file(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically (mode 0600: it names the key file)."""
    return write_private(path, json.dumps(record))  # ASCII: json escapes the rest


def read_ready_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record at ``path``, or None while there is none. Raises `ReadyFileError` for a file
    that is not a ready record of this version."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReadyFileError(f"{path}: not JSON ({e})") from None
    if not isinstance(record, dict) or record.get("v") != READY_FILE_VERSION \
            or isinstance(record.get("v"), bool):
        raise ReadyFileError(f"{path}: not a version {READY_FILE_VERSION} ready record")
    eps = record.get("endpoints")
    if not isinstance(eps, dict) or any(not isinstance(eps.get(n), str) for n in ENDPOINT_NAMES):
        raise ReadyFileError(f"{path}: ready record without its endpoints")
    if not isinstance(record.get("pid"), int):
        raise ReadyFileError(f"{path}: ready record without a pid")
    return record


def remove_ready_file(path: str | os.PathLike[str], pid: int) -> bool:
    """Remove the file if it is this process's record (another engine may have replaced it)."""
    try:
        record = read_ready_file(path)
    except ReadyFileError:
        return False
    if record is None or record.get("pid") != pid:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True
