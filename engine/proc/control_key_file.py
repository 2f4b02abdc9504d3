"""The engine's side of the control key: make it, write its file, check it, remove the file.

Clients only find and read the key (`vconsole.telemetry.control_key`: the path rule and
`load_control_key`, imported by both sides so the path lives in one place); making, writing,
comparing and removing it is the engine's job alone, so it lives here, next to the control
server (`vconsole.engine.proc.control_server`) that checks it.

Invariants: the key file is written atomically with mode 0600 (a reader sees no key or the whole
key, and only the engine's user can read it); it is removed only while it still holds this
engine's key (a second engine on the same endpoint may have replaced it); the comparison takes
constant time, and anything but a non-empty string is no key.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path

from vconsole.telemetry.control_key import NOT_AUTHORISED, read_key_file

KEY_BYTES = 32


def new_key() -> str:
    """A fresh key: `KEY_BYTES` random bytes as hex (one per engine start)."""
    return secrets.token_hex(KEY_BYTES)


def write_key_file(path: str | os.PathLike[str], key: str) -> Path:
    """Write ``key`` to ``path`` atomically (temp file in the same folder, then rename), mode
    0600; a missing folder is created mode 0700. Raises OSError."""
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o600)  # mkstemp makes it 0600 already; be explicit
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(key + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def remove_key_file(path: str | os.PathLike[str], key: str) -> bool:
    """Remove ``path`` if it still holds ``key`` (another engine may have replaced it)."""
    try:
        if read_key_file(path) != key:
            return False
        os.unlink(path)
    except (OSError, ValueError):
        return False
    return True


def key_matches(given: object, expected: str) -> bool:
    """Constant-time comparison; anything but a non-empty string is no key."""
    if not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("utf-8"))


def not_authorised(path: str | os.PathLike[str]) -> str:
    """The ``error`` of an ``ok: false`` reply to a set_config without the right key. Clients
    recognise it by its prefix (`vconsole.telemetry.control_key.NOT_AUTHORISED` + ``:``)."""
    return (f"{NOT_AUTHORISED}: this client does not hold the engine's control key "
            f"({path})")
