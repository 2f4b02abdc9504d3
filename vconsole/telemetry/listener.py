"""`TelemetryListener`: every decoded telemetry message of one endpoint, on a thread of its own.

For programs that watch an engine beside other work (benchmarks, tests, scripts): each message
is decoded with `vconsole.telemetry.schema` and handed to ``on_message`` on the listener's
thread. The console has its own reader (conflation, wakeups); this is the plain version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import zmq

from vconsole.telemetry import schema

POLL_MS = 50


class TelemetryListener:
    def __init__(self, endpoint: str, on_message: Callable[[schema.TelemetryMessage], None],
                 topics: Iterable[str] = ("",)) -> None:
        self._on_message = on_message
        self._stop = threading.Event()
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # keep everything: a listener wants every message
        for topic in topics:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True,
                                        name="telemetry-listener")
        self._thread.start()

    def _run(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self._on_message(schema.decode(sock.recv_multipart()))
        finally:
            sock.close(0)

    def close(self, timeout_s: float | None = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
