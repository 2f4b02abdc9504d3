"""CURVE key files: the layout `vconsole keys` writes, and how a client reads its keys.

ZeroMQ CURVE (CurveZMQ) encrypts a connection and authenticates both ends: the engine holds a
*server* key pair and an allow-list of client public keys; a client holds the server's public key
(so it cannot be fooled by another server) and its own key pair (so the engine can tell whether
it is allowed in). A client whose public key is not on the list never completes the handshake:
it gets no reply at all, and nothing it sends reaches the engine.

Files are zmq.auth certificates (``zmq.auth.load_certificate`` reads them):

- ``NAME.key``: the public key only. Safe to copy anywhere.
- ``NAME.key_secret``: the public and the secret key. Mode 0600; it never leaves its machine.

`make_keys` (``vconsole keys DIR``) writes a server pair and a client pair into DIR and a copy of
the client's public key into ``DIR/authorized_clients/`` (the engine's ``--curve-clients``). The
engine's side (socket options, the allow-list check) is `vconsole.security.curve_server`.

Invariants: a secret file is refused when other users may read it (like ssh does), so a key
that leaked by its mode is never used; `make_keys` never overwrites an existing key file and a
secret file is never visible with a wider mode than 0600 (it is made in a private folder, then
linked into place).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVER = "server"
CLIENT = "client"
AUTHORIZED_CLIENTS = "authorized_clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class CurveKeyError(ValueError):
    """A key file is missing, unreadable, of the wrong kind or too widely readable."""


def _require_curve() -> None:
    import zmq

    if not zmq.has("curve"):
        raise CurveKeyError("this libzmq was built without CURVE support (libsodium); "
                            "install a pyzmq wheel with CURVE or use an SSH tunnel instead")


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"cannot read the CURVE key file {path}: {e}") from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise CurveKeyError(f"{path} does not hold a CURVE key (40 Z85 characters)")
    return public, secret


def read_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key (Z85) in ``path``: a ``.key`` or a ``.key_secret`` file."""
    return _load(path)[0]


def read_key_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file that only its owner can read."""
    public, secret = _load(path)
    if secret is None:
        raise CurveKeyError(f"{path} holds only a public key; pass the secret certificate "
                            f"(the {SECRET_SUFFIX} file made with it)")
    if os.name == "posix":
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise CurveKeyError(f"{path} is readable by other users (mode {mode:04o}): "
                                f"`chmod 600 {path}` before using it as a secret key")
    return public, secret


@dataclass(frozen=True)
class ClientCurve:
    """A client's CURVE keys (Z85): the server's public key and this client's own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE client; call before ``connect``."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def load_client_curve(server_public: str | os.PathLike[str] | None,
                      client_key: str | os.PathLike[str] | None) -> ClientCurve | None:
    """The client's keys from ``--curve-server-public`` and ``--curve-client-key``; None when
    neither is given (a plain connection). Raises `CurveKeyError` when only one is, or a file
    is wrong."""
    if not server_public and not client_key:
        return None
    if not server_public or not client_key:
        raise CurveKeyError("CURVE needs both --curve-server-public (the engine's "
                            f"{SERVER}{PUBLIC_SUFFIX}) and --curve-client-key (this client's "
                            f"{CLIENT}{SECRET_SUFFIX})")
    _require_curve()
    public, secret = read_key_pair(client_key)
    return ClientCurve(read_public_key(server_public), public, secret)


@dataclass(frozen=True)
class KeySet:
    """The files `make_keys` wrote or kept."""

    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized: Path        # the folder to pass as the engine's --curve-clients
    server_created: bool


def _stage(stage: Path, name: str) -> tuple[Path, Path]:
    import zmq.auth

    public, secret = (Path(p) for p in zmq.auth.create_certificates(stage, name))
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def _place(src: Path, dest: Path) -> None:
    """Link ``src`` to ``dest``, never replacing a file that is there."""
    try:
        os.link(src, dest)
    except FileExistsError:
        raise CurveKeyError(f"{dest} exists; refusing to overwrite a key") from None
    except OSError:                  # a file system without hard links
        if dest.exists():
            raise CurveKeyError(f"{dest} exists; refusing to overwrite a key") from None
        shutil.copy2(src, dest)


def make_keys(directory: str | os.PathLike[str], client: str = CLIENT) -> KeySet:
    """Write a client key pair named ``client`` (and the server pair, unless ``server.key_secret``
    is already there) into ``directory`` (created mode 0700), and authorise the client by copying
    its public key into ``directory/authorized_clients``. Raises `CurveKeyError` if the client's
    files exist (nothing is overwritten) or the name is not a plain file name."""
    _require_curve()
    if not client or client in (SERVER, ".", "..") or os.sep in client or "/" in client:
        raise CurveKeyError(f"bad client name {client!r}: a plain file name other than "
                            f"{SERVER!r}")
    root = Path(directory).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    authorized = root / AUTHORIZED_CLIENTS
    authorized.mkdir(mode=0o700, exist_ok=True)
    server_pub, server_sec = root / f"{SERVER}{PUBLIC_SUFFIX}", root / f"{SERVER}{SECRET_SUFFIX}"
    client_pub, client_sec = root / f"{client}{PUBLIC_SUFFIX}", root / f"{client}{SECRET_SUFFIX}"
    for path in (client_pub, client_sec, authorized / client_pub.name):
        if path.exists():
            raise CurveKeyError(f"{path} exists; refusing to overwrite a key (choose another "
                                "--client name or another folder)")
    if server_sec.exists():
        read_key_pair(server_sec)            # a usable server pair, kept as it is
    stage = Path(tempfile.mkdtemp(prefix=".vconsole-keys-", dir=root))   # mode 0700
    try:
        server_created = not server_sec.exists()
        if server_created:
            pub, sec = _stage(stage, SERVER)
            _place(sec, server_sec)
            if server_pub.exists():
                server_pub.unlink()          # a stale public half of a pair that is gone
            _place(pub, server_pub)
        pub, sec = _stage(stage, client)
        _place(sec, client_sec)
        _place(pub, client_pub)
        _place(pub, authorized / client_pub.name)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(stage)
    return KeySet(server_pub, server_sec, client_pub, client_sec, authorized, server_created)
