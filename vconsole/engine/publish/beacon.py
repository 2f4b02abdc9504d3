"""HealthBeacon: ``health`` heartbeats (and the restart as an ``alert`` event) on an engine's
telemetry endpoint while no engine owns it.

The engine's supervisor (`vconsole.engine.launch.supervisor`) binds one between an engine process
that died and the next one, so a console keeps hearing from the endpoint it watches, with state
``restarting``, the reason and the restart count, instead of silence. Same wire format as the
engine's publisher: the body is `vconsole.engine.publish.bodies.health_body`, encoded by
`vconsole.telemetry.schema`.

Invariants: one thread uses a beacon (no thread of its own: the caller sends each heartbeat);
sends never block (``NOBLOCK`` on a PUB, which drops at the high-water mark); ``seq`` counts
from 0 per topic per beacon, so a subscriber sees the publisher restart, as it does for a new engine. The
caller owns the context and closes the beacon before the next engine binds the endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from vconsole.engine.publish.bodies import health_body
from vconsole.telemetry import schema


class HealthBeacon:
    """A PUB socket bound to ``endpoint`` that sends ``health`` and nothing else."""

    def __init__(self, ctx: zmq.Context, endpoint: str, engine_id: str, rank: int, *,
                 sndhwm: int = 1000, secure: Callable[[zmq.Socket], None] | None = None) -> None:
        """Bind now; raises `zmq.ZMQError` when the endpoint cannot be bound. ``secure(sock)``
        sets the socket's security options (the engine's CURVE keys) before the bind."""
        self.engine_id = engine_id
        self.rank = rank
        self._seq: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._t0_wall = time.time()
        self._sock = ctx.socket(zmq.PUB)
        try:
            self._sock.setsockopt(zmq.SNDHWM, sndhwm)
            self._sock.setsockopt(zmq.LINGER, 0)
            if secure is not None:
                secure(self._sock)
            self._sock.bind(endpoint)
        except BaseException:
            self._sock.close(0)
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint

    def send(self, state: str, *, interval_s: float, **fields: Any) -> bool:
        """Send one heartbeat (``fields``: any other `health_body` argument). False when the
        socket refused it (at the high-water mark)."""
        body = health_body(state, uptime_s=time.monotonic() - self._t0, steps=0,
                           interval_s=interval_s, started_ts=self._t0_wall, **fields)
        return self._send("health", body)

    def send_alert(self, body: dict[str, Any]) -> bool:
        """Send one ``alert`` (an `AlertEvent.payload`): the restart as an event, not only a
        state. False at the high-water mark."""
        return self._send("alert", body)

    def _send(self, topic: str, body: dict[str, Any]) -> bool:
        seq = self._seq[topic] = self._seq.get(topic, -1) + 1     # per topic, from 0
        payload = {**schema.make_envelope(self.engine_id, self.rank, seq, time.time()), **body}
        try:
            self._sock.send_multipart(schema.encode(topic, payload), flags=zmq.NOBLOCK,
                                      copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> HealthBeacon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
