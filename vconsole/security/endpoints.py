"""Default socket endpoints. Every socket binds loopback unless told otherwise; a client command
with no flags finds an engine started with no flags."""

from __future__ import annotations

import ipaddress

DEFAULT_INPUT = "tcp://127.0.0.1:5570"
DEFAULT_OUTPUT = "tcp://127.0.0.1:5571"
DEFAULT_TELEMETRY = "tcp://127.0.0.1:5572"
DEFAULT_CONTROL = "tcp://127.0.0.1:5573"

DEFAULTS = {
    "input": DEFAULT_INPUT,
    "output": DEFAULT_OUTPUT,
    "telemetry": DEFAULT_TELEMETRY,
    "control": DEFAULT_CONTROL,
}


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// / inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve anywhere
