"""Which engine sockets may bind beyond loopback, and the seam where authentication will go.

Anything that can change the engine (input, output's pair, control) stays on loopback or ipc
until CURVE authentication exists; the read-only telemetry socket may be exposed with an explicit
opt-in.
"""

from __future__ import annotations

import logging

import zmq

from vconsole.telemetry.endpoints import is_loopback

log = logging.getLogger("vconsole.engine")


class RemoteBindRefused(ValueError):
    pass


# Sockets that only publish (nothing sent to them changes the engine) may be exposed without
# authentication when the operator opts in; input and control never are until CURVE exists.
READ_ONLY_SOCKETS = frozenset({"telemetry"})


def check_endpoints(endpoints: dict[str, str], allow_remote: bool) -> None:
    """Refuse non-loopback binds for anything that can change the engine; a read-only socket
    (telemetry) may be remote only with the explicit opt-in."""
    remote = {name: ep for name, ep in endpoints.items() if not is_loopback(ep)}
    steering = [f"{n}={ep}" for n, ep in remote.items() if n not in READ_ONLY_SOCKETS]
    if steering:
        raise RemoteBindRefused(
            f"refusing to bind non-loopback endpoint(s) {', '.join(steering)}: these sockets "
            "can submit requests or change the config, and the engine has no authentication yet "
            "(CURVE comes later). Bind 127.0.0.1 or ipc:// and reach them over an ssh -L tunnel.")
    if remote and not allow_remote:
        eps = ", ".join(f"{n}={ep}" for n, ep in remote.items())
        raise RemoteBindRefused(
            f"refusing to bind non-loopback endpoint(s) {eps} without --allow-remote-telemetry: "
            "telemetry is unauthenticated and readable by anyone who can reach the port.")


def secure_socket(sock: zmq.Socket, name: str, endpoint: str) -> None:
    """The seam for authentication: CURVE server keys (``CURVE_SERVER``, ``CURVE_SECRETKEY``)
    and a ZAP handler will be set here for non-loopback endpoints. No-op today: remote binds are
    only allowed for read-only sockets, with ``--allow-remote-telemetry``."""
    if not is_loopback(endpoint):
        log.warning("%s socket on %s is unauthenticated (--allow-remote-telemetry)", name, endpoint)
