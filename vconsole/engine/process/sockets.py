"""The engine process's three ROUTERs, bound in the constructor so a busy port fails fast.

`check_before_bind` refuses, before anything binds, an endpoint the bind policy forbids
(`vconsole.security.bind_policy`: beyond loopback only with ``allow_remote``, and as CURVE
servers when the engine has keys) and a control key file a running engine holds.
`bind_routers` binds input, output and control with the config's ZeroMQ limits (linger, send
high-water mark, largest message) as CURVE servers when the engine has keys
(`vconsole.security.bind_policy.secure_socket`), writes back the endpoints actually bound (a
``*`` port resolved), and makes the output ROUTER ``ROUTER_MANDATORY`` (an output for a client
that is gone raises instead of vanishing). From then on each socket belongs to its thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

from vconsole.engine.publish.kv_events import kv_event_endpoints
from vconsole.security.bind_policy import check_endpoints, check_metrics_host, secure_socket
from vconsole.security.control_key import control_key_file as key_file_for
from vconsole.security.engine_key import refuse_if_held

if TYPE_CHECKING:
    from vconsole.security.curve_server import ServerCurve
    from vconsole.shared.config import EngineConfig

ROUTERS = ("input", "output", "control")


def check_before_bind(config: EngineConfig, endpoints: dict[str, str], *, allow_remote: bool,
                      curve: bool, control_key_file: str | None,
                      metrics_endpoint: tuple[str, int] | None,
                      allow_remote_metrics: bool) -> None:
    """Raises `RemoteBindRefused` (a ValueError) or `KeyFileHeld` (an OSError)."""
    check_endpoints(endpoints, allow_remote, curve=curve)
    check_endpoints(kv_event_endpoints(config), allow_remote)   # never CURVE: see there
    if metrics_endpoint is not None:   # (host, port): Prometheus /metrics, port 0 = any
        check_metrics_host(metrics_endpoint[0], allow_remote_metrics)
    refuse_if_held(key_file_for(endpoints["control"], control_key_file))


def bind_routers(ctx: zmq.Context, endpoints: dict[str, str], config: EngineConfig,
                 curve: ServerCurve | None) -> dict[str, zmq.Socket]:
    """The bound sockets by name; ``endpoints`` updated in place. Raises OSError naming the
    socket and endpoint that could not be bound, after closing those that were."""
    sockets: dict[str, zmq.Socket] = {}
    try:
        for name in ROUTERS:
            sockets[name] = _bind(ctx, name, endpoints, config, curve)
    except BaseException:
        for sock in sockets.values():
            sock.close(0)
        raise
    sockets["output"].setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sockets


def _bind(ctx: zmq.Context, name: str, endpoints: dict[str, str], config: EngineConfig,
          curve: ServerCurve | None) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, config.zmq_linger_ms)
        sock.setsockopt(zmq.SNDHWM, config.zmq_sndhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, config.zmq_maxmsgsize)
        secure_socket(sock, name, endpoints[name], curve)
        sock.bind(endpoints[name])
        endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoints[name]
    except zmq.ZMQError as e:
        sock.close(0)
        raise OSError(f"cannot bind the {name} socket to {endpoints[name]}: {e}") from None
    return sock
