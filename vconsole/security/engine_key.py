"""The engine's side of the control key: make it, write its file, check it, remove the file.

Clients only find and read the key (`vconsole.security.control_key`: the path rule and
`load_control_key`, imported by both sides so the path lives in one place); making, writing,
comparing and removing it is the engine's job alone, so it lives here, next to the control
server (`vconsole.engine.process.control_server`) that checks it.

Invariants: the key file is written atomically with mode 0600 (a reader sees no key or the whole
key, and only the engine's user can read it); it is removed only while it still holds this
engine's key (a second engine on the same endpoint may have replaced it); the comparison takes
constant time, and anything but a non-empty string is no key.

Stale files: next to the key the engine writes its owner record
(`vconsole.security.key_owner`: pid, start time, host, engine id, a fingerprint of the key),
the record first and the key second. `claim_key_file` replaces a key file whose engine is gone
(killed without cleaning up) with a warning, and refuses (`KeyFileHeld`) one whose engine is
still running on this host: two engines on one control endpoint is a mistake, and the first
one's key must stay valid. `refuse_if_held` is the same check alone, for before any bind (an
``ipc://`` bind would take the path from the running engine).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import tempfile
from pathlib import Path

from vconsole.security import key_owner
from vconsole.security.control_key import NOT_AUTHORISED, read_key_file
from vconsole.security.key_owner import GONE, RUNNING, UNKNOWN, KeyOwner, KeyStatus

log = logging.getLogger("vconsole.engine")

KEY_BYTES = 32


class KeyFileHeld(OSError):
    """The key file belongs to an engine that is still running."""


def new_key() -> str:
    """A fresh key: `KEY_BYTES` random bytes as hex (one per engine start)."""
    return secrets.token_hex(KEY_BYTES)


def write_key_file(path: str | os.PathLike[str], key: str) -> Path:
    """Write ``key`` to ``path`` atomically (temp file in the same folder, then rename), mode
    0600; a missing folder is created mode 0700. Raises OSError."""
    return write_private(path, key + "\n")


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ASCII ``text`` atomically (temp file, fsync, rename), mode 0600, in a folder made
    0700 if missing: a reader sees the old file or the whole new one."""
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o600)  # mkstemp makes it 0600 already; be explicit
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def holder(path: str | os.PathLike[str]) -> KeyStatus | None:
    """The state of the engine behind the key file at ``path``; None when there is no file."""
    try:
        key = read_key_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return KeyStatus(key_owner.UNRECORDED)
    return key_owner.status(path, key)


def refuse_if_held(path: str | os.PathLike[str]) -> KeyStatus | None:
    """Raise `KeyFileHeld` if the key file at ``path`` belongs to another process that is still
    running; else return what `holder` found (None: no file)."""
    found = holder(path)
    if found is not None and found.state == RUNNING and found.owner is not None \
            and found.owner.pid != os.getpid():
        raise KeyFileHeld(
            f"the control key file {path} belongs to {found.owner.describe()}, which is still "
            f"running on control endpoint {found.owner.endpoint}: stop that engine first, or "
            "give this one other endpoints (or another --control-key-file)")
    return found


def claim_key_file(path: str | os.PathLike[str], key: str, *, engine_id: str,
                   endpoint: str) -> Path:
    """Write this engine's owner record, then ``key``, to ``path`` (see the module docstring):
    a stale file is replaced (logged), one held by a running engine is refused (`KeyFileHeld`).
    Raises OSError."""
    found = refuse_if_held(path)
    if found is not None:
        if found.state == GONE and found.owner is not None:
            why = f"left by {found.owner.describe()}, which is no longer running"
        elif found.state == UNKNOWN and found.owner is not None:
            why = f"written by {found.owner.describe()}; that host's engine cannot be checked"
        elif found.state == RUNNING:
            why = "left by an earlier engine in this process"
        else:
            why = "it has no owner record"
        log.warning("replacing the control key file %s: %s", path, why)
    owner = KeyOwner.for_this_process(key, engine_id=engine_id, endpoint=endpoint)
    write_private(key_owner.owner_path(path), owner.to_json() + "\n")
    return write_key_file(path, key)


def remove_key_file(path: str | os.PathLike[str], key: str) -> bool:
    """Remove ``path`` if it still holds ``key`` (another engine may have replaced it), and
    then its owner record if that record is this key's."""
    try:
        if read_key_file(path) != key:
            return False
        os.unlink(path)
    except (OSError, ValueError):
        return False
    owner = key_owner.read_owner(path)
    if owner is not None and owner.key_id == key_owner.key_id(key):
        with contextlib.suppress(OSError):
            os.unlink(key_owner.owner_path(path))
    return True


def key_matches(given: object, expected: str) -> bool:
    """Constant-time comparison; anything but a non-empty string is no key."""
    if not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("utf-8"))


def not_authorised(path: str | os.PathLike[str]) -> str:
    """The ``error`` of an ``ok: false`` reply to a set_config without the right key. Clients
    recognise it by its prefix (`vconsole.security.control_key.NOT_AUTHORISED` + ``:``)."""
    return (f"{NOT_AUTHORISED}: this client does not hold the engine's control key "
            f"({path})")
