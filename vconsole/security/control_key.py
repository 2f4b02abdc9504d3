"""The control key: a shared secret that says "this client may change the engine".

At start the engine makes a random key (32 bytes, hex) and writes it atomically to a file only
its user can read (mode 0600), at a path derived from the control endpoint it bound
(`control_key_file`): ``<runtime dir>/control-<endpoint>.key``, the runtime dir being
``$VCONSOLE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/vconsole``, else ``~/.cache/vconsole/run``.
A client on the same machine, as the same user, derives the same path from the same endpoint
(`load_control_key`), so a bare `vconsole set` finds a bare engine's key; ``--control-key-file``
names another path on either side. The engine removes the file on a clean shutdown (only if it
still holds this engine's key). Making, writing, comparing and removing the key is the engine's
alone: `vconsole.security.engine_key`.

Clients send the key as ``"key"`` in every control request. ``get_config`` is open (read-only);
``set_config`` without the right key (compared in constant time) is answered ``ok: false`` with
an ``error`` starting `NOT_AUTHORISED` + ``:``, and changes nothing.

Anyone who can read the file can steer the engine. Without CURVE the key travels in clear, which
is why a control endpoint beyond loopback needs CURVE keys (`vconsole.security.curve`); with
them the key is still required for ``set_config`` (CURVE says who may connect, the key who may
steer). Next to the key file the engine writes an owner record (`vconsole.security.key_owner`)
that tells a stale file, left by a killed engine, from a live one.

Both sides import this module, so the path rule lives in exactly one place.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

ENV_RUNTIME_DIR = "VCONSOLE_RUNTIME_DIR"
NOT_AUTHORISED = "not authorised"
_MAX_NAME = 120           # longer endpoint names (deep ipc paths) are shortened with a hash
_UNSAFE = re.compile(r"[^A-Za-z0-9._]+")


def runtime_dir() -> Path:
    """Where key files live by default (not created here)."""
    explicit = os.environ.get(ENV_RUNTIME_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "vconsole"
    return Path.home() / ".cache" / "vconsole" / "run"


def key_file_name(endpoint: str) -> str:
    """``tcp://127.0.0.1:5573`` -> ``control-127.0.0.1-5573.key``; ``ipc:///tmp/x/control`` ->
    ``control-ipc-tmp-x-control.key``. ``localhost`` is spelled 127.0.0.1 (what a bind reports)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = "", endpoint
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        rest = f"{'127.0.0.1' if host == 'localhost' else host}:{port}"
        scheme = ""
    name = _UNSAFE.sub("-", f"{scheme}-{rest}" if scheme else rest).strip("-.") or "endpoint"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
        name = f"{name[:_MAX_NAME - 17]}-{digest}"
    return f"control-{name}.key"


def control_key_file(endpoint: str, given: str | os.PathLike[str] | None = None) -> Path:
    """The control key file for ``endpoint``: ``given`` (``--control-key-file``) when set, else
    derived under `runtime_dir`. One name for this path everywhere: the flag, the ready file's
    field and every variable that holds it say ``control_key_file``."""
    if given:
        return Path(given).expanduser()
    return runtime_dir() / key_file_name(endpoint)



def read_key_file(path: str | os.PathLike[str]) -> str:
    """The key in ``path``; raises OSError (unreadable) or ValueError (empty / not a key)."""
    text = Path(path).read_text(encoding="ascii", errors="replace").strip()
    if not text or not all(c in "0123456789abcdefABCDEF" for c in text):
        raise ValueError(f"{path} does not hold a control key")
    return text


def load_control_key(endpoint: str, path: str | os.PathLike[str] | None = None) -> str | None:
    """The engine's key for ``endpoint`` (from ``path`` when given), or None if it cannot be
    read: the caller is then read-only."""
    try:
        return read_key_file(control_key_file(endpoint, path))
    except (OSError, ValueError):
        return None
