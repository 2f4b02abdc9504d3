"""`CommandChannel`: other threads' commands to a thread that owns ZeroMQ sockets.

ZeroMQ sockets are not thread-safe, so the data-parallel front end and the telemetry proxy each
keep theirs on one thread; the launcher's threads reach it through an inproc PUSH/PULL pair. The
owning thread waits with `poll`, which returns the commands that arrived (tuples whose first
item names the command) and its other sockets that are readable. Sending after `close_sender` is a no-op: a late ``rank_down`` after
shutdown has nothing left to tell.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq


class CommandChannel:
    def __init__(self, ctx: zmq.Context, name: str) -> None:
        addr = f"inproc://{name}-{id(self)}"
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(addr)
        self._out: zmq.Socket | None = ctx.socket(zmq.PUSH)
        self._out.connect(addr)
        self._lock = threading.Lock()
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)

    def send(self, *cmd: Any) -> None:
        """Any thread: queue ``cmd`` for the owning thread (ignored once closed)."""
        with self._lock:
            if self._out is not None:
                self._out.send_pyobj(cmd)

    def poll(self, timeout_ms: int) -> tuple[list[tuple[Any, ...]], list[zmq.Socket]]:
        """The owning thread: wait up to ``timeout_ms`` on `poller` (the inbox and whatever
        sockets the owner registered there); the commands queued, in order, and the owner's
        sockets that are readable."""
        commands: list[tuple[Any, ...]] = []
        ready: list[zmq.Socket] = []
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is not self.inbox:
                ready.append(sock)
                continue
            while True:
                try:
                    commands.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return commands, ready

    def close_sender(self) -> None:
        with self._lock:
            if self._out is not None:
                self._out.close(0)
                self._out = None

    def close(self) -> None:
        """The owning thread, or any once it has stopped: both ends."""
        self.close_sender()
        self.inbox.close(0)
