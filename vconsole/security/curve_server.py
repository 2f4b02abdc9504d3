"""The engine's side of CURVE: its key pair on every socket it binds, and the allow-list check.

With ``--curve-server-key`` and ``--curve-clients`` every socket the engine binds (input,
output, control, telemetry) is a CURVE server: traffic is encrypted, and a connection completes
its handshake only when the client knows the engine's public key and its own public key is in
the allow-list (the ``*.key`` files in the clients folder, read once at start). The check runs
in a ZAP handler (``zmq.auth.thread.ThreadAuthenticator``) on the engine's context; it is
started before the first bind, because a CURVE socket without a ZAP handler accepts any client.

A refused client learns nothing (ZeroMQ gives it no reply and keeps retrying); the engine logs
its public key once, so an operator can authorise it by copying a file. Client key files and
the file layout: `vconsole.security.curve`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from vconsole.security.curve import (
    AUTHORIZED_CLIENTS,
    SECRET_SUFFIX,
    SERVER,
    CurveKeyError,
    read_key_pair,
)

log = logging.getLogger("vconsole.engine")

MAX_LOGGED_REFUSALS = 64      # distinct refused keys named in the log; later ones only counted
ZAP_DOMAIN = "vconsole"      # every engine CURVE socket asks the ZAP handler under this domain


@dataclass(frozen=True)
class ServerCurve:
    """The engine's key pair (Z85) and the public keys of the clients allowed in."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]
    clients_dir: Path

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server; call before ``bind``."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())

    def start_authenticator(self, ctx: zmq.Context) -> CurveAuthenticator:
        return CurveAuthenticator(ctx, self.clients)


def load_server_curve(server_key: str | os.PathLike[str] | None,
                      clients_dir: str | os.PathLike[str] | None) -> ServerCurve | None:
    """The engine's keys from ``--curve-server-key`` and ``--curve-clients``; None when neither
    is given. Raises `CurveKeyError` when only one is, a file is wrong, or the folder authorises
    nobody (an engine no client could reach is a mistake, not a configuration)."""
    if not server_key and not clients_dir:
        return None
    if not server_key or not clients_dir:
        raise CurveKeyError(f"CURVE needs both --curve-server-key (the engine's "
                            f"{SERVER}{SECRET_SUFFIX}) and --curve-clients (a folder of "
                            f"authorised client public keys, e.g. {AUTHORIZED_CLIENTS}/)")
    if not zmq.has("curve"):
        raise CurveKeyError("this libzmq was built without CURVE support (libsodium)")
    public, secret = read_key_pair(server_key)
    folder = Path(clients_dir).expanduser()
    try:
        clients = frozenset(zmq.auth.load_certificates(folder))
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"cannot read the authorised client keys in {folder}: {e}") from None
    if not clients:
        raise CurveKeyError(f"no client public keys (*.key) in {folder}: no client could "
                            "connect. `vconsole keys DIR` makes a client pair and authorises it")
    return ServerCurve(public, secret, clients, folder)


class CurveAuthenticator:
    """The ZAP handler thread for one context: allows exactly ``clients`` (Z85 public keys).

    `stop` before the context is closed (its sockets live in that context)."""

    def __init__(self, ctx: zmq.Context, clients: frozenset[bytes]) -> None:
        self._clients = clients
        self._refused: set[bytes] = set()
        self.refusals = 0
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("vconsole.engine.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials provider hook: ``key`` is the client's Z85 public key."""
        if key in self._clients:
            return True
        with self._lock:
            self.refusals += 1
            first = key not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS
            if first:
                self._refused.add(key)
        if first:
            log.warning("CURVE: refused a client whose public key is not authorised: %s (add "
                        "its .key file to the --curve-clients folder and restart to allow it)",
                        key.decode("ascii", "replace"))
        return False

    def stop(self) -> None:
        self._auth.stop()

    def __enter__(self) -> CurveAuthenticator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
