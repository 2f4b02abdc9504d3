"""Waiting for a ZeroMQ subscriber to be joined instead of sleeping (the slow-joiner problem).

A SUB that has just called ``connect`` misses what its PUB sends until the connection is made
and its subscription has reached the PUB. A PUB that sends on a heartbeat answers that by its
first message; one that sends only on events (KV events) gives no such sign, so the test waits
for the ZMTP handshake on its own socket: once it has succeeded, the subscription goes out at
once, long before the PUB's first event (a request must be scheduled and stepped first).
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message


def connect_joined(sock: zmq.Socket, endpoint: str, timeout_s: float = 30.0) -> None:
    """Connect ``sock`` to ``endpoint`` and return once the handshake with the peer there has
    succeeded (the monitor is attached before connecting, so the event cannot be missed)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not monitor.poll(left_ms):
                raise AssertionError(f"no ZeroMQ handshake within {timeout_s:g} s")
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
    finally:
        sock.disable_monitor()
        monitor.close(0)
