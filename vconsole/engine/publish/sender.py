"""The publisher's PUB socket and what sending on it counts: per-topic ``seq``, messages
sent, drops at the high-water mark, encode errors, and the last message of each topic.

Why apart from the loop: ``seq`` must keep counting when the publisher thread starts a failed
loop over (a subscriber would take a ``seq`` that goes back for a new engine), and exporters
(Prometheus) read the last messages from another thread.

Invariant: the engine pays nothing for a slow or absent subscriber. Sends are ``NOBLOCK`` on a
PUB with ``sndhwm = zmq_sndhwm`` (PUB drops at the high-water mark instead of blocking); a send
that still reports EAGAIN is counted in ``send_drops`` (``health.send_drops``). Subscribers
count their own losses from the per-topic ``seq`` gaps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from vconsole.telemetry import schema

log = logging.getLogger(__name__)


class Sender:
    """Sends one engine's messages on ``sock`` (bound, owned by the publisher thread: only
    that thread calls `send`)."""

    def __init__(self, sock: zmq.Socket, engine_id: str, rank: int) -> None:
        self.sock = sock
        self.engine_id = engine_id
        self.rank = rank
        self._seq: dict[str, int] = dict.fromkeys(schema.TOPICS, 0)
        self.sent: dict[str, int] = dict.fromkeys(schema.TOPICS, 0)
        self.send_drops = 0
        self.encode_errors = 0
        self._lock = threading.Lock()     # guards _last_bodies (read by exporters)
        self._last_bodies: dict[str, dict[str, Any]] = {}

    def send(self, topic: str, body: dict[str, Any]) -> None:
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        payload = {**schema.make_envelope(self.engine_id, self.rank, seq, time.time()), **body}
        try:
            frames = schema.encode(topic, payload)
        except schema.SchemaError:
            self.encode_errors += 1
            log.exception("telemetry: cannot encode a %s message", topic)
            return
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.sent[topic] += 1
        except zmq.Again:
            self.send_drops += 1
        with self._lock:
            self._last_bodies[topic] = payload

    def last_bodies(self) -> dict[str, dict[str, Any]]:
        """The last message sent on each topic (envelope included): what a subscriber saw
        last."""
        with self._lock:
            return dict(self._last_bodies)
