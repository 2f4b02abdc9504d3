"""The engine process's output thread: the output ROUTER, and every message to a client.

`vconsole.engine.process.core_proc.EngineCoreProc` binds the socket and hands it to an
`OutputThread`, which from then on is its only user (and closes it). The busy loop and the input
thread talk to it through the output queue (`vconsole.engine.process.output_items`):

- `Hello`: answer with ``ready`` — retried every `HELLO_RETRY_S` until the client's output
  connection is registered (at most `HELLO_WAIT_S`), so once a client has its ``ready`` no
  output to it can be lost; from then on the client is *handshaken*;
- `Outputs` and `Error`: to that client. A finished output's ``text`` is detokenized here, just
  before it is encoded, never on the busy loop;
- `Wave`: a data-parallel rank's ``wave`` message, to every handshaken client;
- `STOP`: flush what was queued before it, close the socket, end.

Every handshaken client also gets a ``heartbeat`` at least once per ``client_heartbeat_s``.

The socket is ``ROUTER_MANDATORY`` and sends never block: a client that is no longer connected,
or whose queue is full (``zmq_sndhwm`` messages: it stopped reading), is marked gone at once —
``on_client_gone`` tells the busy loop, which aborts its requests — and whatever is still queued
for it is dropped, so one stuck client never delays the outputs of the others. A new ``hello``
from a gone client makes it a client again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from vconsole.engine.process.output_items import Error, Hello, OutputItem, Outputs, Stop, Wave
from vconsole.wire import protocol

log = logging.getLogger("vconsole.engine")

HELLO_RETRY_S = 0.005     # ready re-sent this often until the client's output socket is known
HELLO_WAIT_S = 5.0        # ...for at most this long
SENT, NO_ROUTE, FULL = "sent", "no route", "full"  # `send` results


class OutputThread(threading.Thread):
    """Owns the output socket from `start` on; see the module docstring."""

    def __init__(self, sock: zmq.Socket, items: queue.SimpleQueue[OutputItem], *,
                 ready: Callable[[], dict[str, Any]], heartbeat_s: Callable[[], float],
                 engine_id: str, on_client_gone: Callable[[bytes], None],
                 detokenize: Callable[[list[int]], str]) -> None:
        super().__init__(name="engine-output", daemon=True)
        self.sock = sock
        self.items = items
        self._ready = ready
        self._heartbeat_s = heartbeat_s
        self._heartbeat = protocol.encode_heartbeat(engine_id)
        self._on_client_gone = on_client_gone
        self._detokenize = detokenize
        self.hellos: dict[bytes, float] = {}  # client id -> give-up time, while its route is unknown
        self.gone: set[bytes] = set()
        self.clients: set[bytes] = set()      # handshaken clients: heartbeats, wave messages

    def run(self) -> None:
        next_beat = time.monotonic()
        try:
            while True:
                wait = max(0.0, next_beat - time.monotonic())
                item: OutputItem | None
                try:
                    item = self.items.get(timeout=min(wait, HELLO_RETRY_S) if self.hellos
                                          else wait)
                except queue.Empty:
                    item = None
                if isinstance(item, Stop):
                    return
                if item is not None:
                    self._on_item(item)
                if time.monotonic() >= next_beat:
                    self._broadcast(self._heartbeat)   # the clients' liveness signal
                    next_beat = time.monotonic() + self._heartbeat_s()
                self._answer_hellos()
        finally:
            self.sock.close()

    def _answer_hellos(self) -> None:
        for client_id, give_up in list(self.hellos.items()):
            sent = self.send(self.sock, client_id, protocol.encode_ready(self._ready()))
            if sent == NO_ROUTE:
                if time.monotonic() > give_up:
                    del self.hellos[client_id]
                    log.warning("hello from %s: its output socket never connected",
                                client_id.decode(errors="replace"))
            else:
                del self.hellos[client_id]
                self.clients.add(client_id)
                if sent == FULL:
                    self._client_gone(client_id, sent)

    def _on_item(self, item: OutputItem) -> None:
        match item:
            case Hello(client_id):
                self.gone.discard(client_id)
                self.hellos[client_id] = time.monotonic() + HELLO_WAIT_S
                return
            case Wave(event, wave):
                self._broadcast(protocol.encode_wave(event, wave))
                return
            case Outputs(client_id, outputs, to_detokenize):
                if client_id in self.gone:   # its requests are being aborted; nobody reads
                    return
                for out, token_ids in to_detokenize:
                    out.text = self._text(token_ids)
                frames = protocol.encode_outputs(outputs)
            case Error(client_id, reason, request_id, in_flight):
                if client_id in self.gone:
                    return
                frames = protocol.encode_error(reason, request_id, in_flight)
            case _:
                return
        sent = self.send(self.sock, client_id, frames)
        if sent != SENT:
            self._client_gone(client_id, sent)

    def _text(self, token_ids: list[int]) -> str | None:
        """A finished request's text; a tokenizer that raises costs that text only (None),
        never this thread."""
        try:
            return self._detokenize(token_ids)
        except Exception:
            log.exception("could not detokenize a finished output; it is sent without text")
            return None

    def _broadcast(self, frames: protocol.Frames) -> None:
        """Send to every handshaken client. A client whose route is gone is forgotten; one
        whose queue is full is treated as any stuck client."""
        for client_id in list(self.clients):
            if client_id in self.gone:
                self.clients.discard(client_id)
                continue
            sent = self.send(self.sock, client_id, frames)
            if sent == NO_ROUTE:
                self.clients.discard(client_id)
            elif sent == FULL:
                self.clients.discard(client_id)
                self._client_gone(client_id, sent)

    def _client_gone(self, client_id: bytes, why: str) -> None:
        self.gone.add(client_id)
        log.warning("client %s: %s; dropping its outputs", client_id.decode(errors="replace"),
                    "not reading its outputs (send queue full)" if why == FULL
                    else "no output connection")
        self._on_client_gone(client_id)

    @staticmethod
    def send(sock: zmq.Socket, client_id: bytes, frames: protocol.Frames) -> str:
        """Never blocks. `SENT`; `NO_ROUTE` when the client has no output connection (not yet,
        or no longer); `FULL` when its queue is at the high-water mark (it stopped reading)."""
        try:
            sock.send_multipart([client_id, *frames], flags=zmq.NOBLOCK, copy=False)
            return SENT
        except zmq.Again:
            return FULL
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return NO_ROUTE
            raise
