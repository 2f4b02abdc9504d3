"""Which engine sockets may bind beyond loopback, and how each socket is secured before it binds.

Anything that can change the engine (input, output's pair, control) binds beyond loopback only
with CURVE (`vconsole.security.curve_server`): encrypted, and only clients whose public key is
on the engine's allow-list get through. Without keys those sockets stay on loopback or ipc://,
where the operating system's users are the boundary (reach them from elsewhere over an SSH
tunnel). The read-only telemetry socket may go remote without keys, with an explicit opt-in
(``--allow-remote-telemetry``): anyone who can reach the port can read it, nobody can change
anything through it. With keys, every socket is CURVE, loopback ones too, so a client holds the
same keys whatever the address. The Prometheus ``/metrics`` endpoint (plain HTTP, read-only)
binds beyond loopback only with ``--allow-remote-metrics``, keys or not (`check_metrics_host`).

Invariant: `check_endpoints` runs before any socket binds, so a refused configuration exposes
nothing, not even for a moment.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from vconsole.security.endpoints import is_loopback

if TYPE_CHECKING:
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine")


class RemoteBindRefused(ValueError):
    pass


# Sockets that only publish (nothing sent to them changes the engine) may be exposed without
# authentication when the operator opts in; input, output and control never are.
READ_ONLY_SOCKETS = frozenset({"telemetry", "kv_events", "kv_events_replay"})

OPTIONS = (
    "Either give the engine CURVE keys (`vconsole keys DIR`, then `vconsole engine "
    "--curve-server-key DIR/server.key_secret --curve-clients DIR/authorized_clients`; clients "
    "pass --curve-server-public DIR/server.key --curve-client-key DIR/client.key_secret), or "
    "bind 127.0.0.1 / ipc:// and reach the engine over an SSH tunnel (ssh -N -L "
    "5570:127.0.0.1:5570 -L 5571:127.0.0.1:5571 -L 5572:127.0.0.1:5572 -L "
    "5573:127.0.0.1:5573 HOST).")


def check_endpoints(endpoints: dict[str, str], allow_remote: bool, curve: bool = False) -> None:
    """Refuse a non-loopback bind of anything that can change the engine unless ``curve``
    (the engine has CURVE keys); a read-only socket (telemetry) may be remote with CURVE or with
    the explicit opt-in ``allow_remote``. Raises `RemoteBindRefused` naming the options."""
    if curve:
        return
    remote = {name: ep for name, ep in endpoints.items() if not is_loopback(ep)}
    steering = [f"{n}={ep}" for n, ep in remote.items() if n not in READ_ONLY_SOCKETS]
    if steering:
        raise RemoteBindRefused(
            f"refusing to bind non-loopback endpoint(s) {', '.join(steering)} without CURVE "
            "keys: these sockets can submit requests or change the config, and without keys "
            f"anyone who can reach the port could. {OPTIONS}")
    if remote and not allow_remote:
        eps = ", ".join(f"{n}={ep}" for n, ep in remote.items())
        raise RemoteBindRefused(
            f"refusing to bind non-loopback endpoint(s) {eps} without --allow-remote-telemetry "
            "or CURVE keys: telemetry without keys is readable by anyone who can reach the port.")


def request_text_refusal(telemetry_endpoint: str, curve: bool) -> str | None:
    """Why the engine may not publish request text (``publish_request_text``: prompts and
    outputs, what users typed) on this telemetry socket, or None when it may. Figures may go
    out beyond loopback without keys (``--allow-remote-telemetry``); text never does: beyond
    loopback it needs CURVE, which encrypts it and lets only the allow-listed clients read it."""
    if curve or is_loopback(telemetry_endpoint):
        return None
    return (f"publish_request_text refused: the telemetry socket {telemetry_endpoint} is "
            "beyond loopback without CURVE, and request text (prompts and outputs) is never "
            "sent in the clear off this host. Bind telemetry to 127.0.0.1 / ipc:// (read it "
            "over an SSH tunnel) or give the engine CURVE keys (`vconsole keys DIR`, "
            "--curve-server-key, --curve-clients).")


def check_metrics_host(host: str, allow_remote: bool) -> None:
    """The Prometheus endpoint (``--metrics-host``) is read-only, like telemetry, but plain HTTP:
    CURVE keys cannot protect it, so a non-loopback host needs its own explicit opt-in
    (``--allow-remote-metrics``) whatever the keys. Raises `RemoteBindRefused`; called with
    `check_endpoints`, before anything binds."""
    endpoint = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if not allow_remote and not is_loopback(endpoint):
        raise RemoteBindRefused(
            f"refusing to serve metrics on non-loopback host {host!r} without "
            "--allow-remote-metrics: /metrics is plain HTTP, readable by anyone who can reach "
            "the port. Bind 127.0.0.1 and scrape over an SSH tunnel (ssh -N -L "
            "PORT:127.0.0.1:PORT HOST), or pass --allow-remote-metrics.")


def bind_socket(ctx: zmq.Context, kind: int, name: str, endpoint: str,
                curve: ServerCurve | None = None, *, sndhwm: int | None = None) -> zmq.Socket:
    """A new ``kind`` socket (linger 0), secured (`secure_socket`) and bound to ``endpoint``;
    read the endpoint actually bound (a ``*`` port resolved) from its ``LAST_ENDPOINT``. A bind
    that fails closes the socket and raises OSError naming the socket and the endpoint."""
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        secure_socket(sock, name, endpoint, curve)
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        raise OSError(f"cannot bind the {name} socket to {endpoint}: {e}") from None
    return sock


def secure_socket(sock: zmq.Socket, name: str, endpoint: str,
                  curve: ServerCurve | None = None) -> None:
    """Called on every engine socket before it binds: with ``curve``, make it a CURVE server
    (its ZAP handler must already run); without, warn about an unauthenticated remote bind
    (only telemetry gets this far, with ``--allow-remote-telemetry``)."""
    if curve is not None:
        curve.secure(sock)
    else:
        secure_socket_warning(name, endpoint)


def secure_socket_warning(name: str, endpoint: str) -> None:
    """Warn about a read-only socket bound beyond loopback without keys."""
    if not is_loopback(endpoint):
        log.warning("%s socket on %s is unauthenticated (--allow-remote-telemetry)", name, endpoint)


def check_http_host(host: str, api_key: bool, open_without_key: bool) -> None:
    """`vconsole serve`'s HTTP server submits requests to the engine: beyond loopback it wants
    an API key (``--api-key``), or the operator's explicit ``--allow-no-api-key`` that says the
    port is open to anyone who reaches it. Raises `RemoteBindRefused` before anything binds."""
    endpoint = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if not api_key and not open_without_key and not is_loopback(endpoint):
        raise RemoteBindRefused(
            f"refusing to serve HTTP on non-loopback host {host!r} without --api-key: anyone "
            "who can reach the port could run requests on the engine. Set --api-key KEY (or "
            "$VCONSOLE_API_KEY), bind 127.0.0.1 and use an SSH tunnel (ssh -N -L "
            "8000:127.0.0.1:8000 HOST), or pass --allow-no-api-key to serve it open.")
