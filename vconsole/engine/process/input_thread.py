"""The engine process's input thread: the input ROUTER, and every message from a client.

`vconsole.engine.process.core_proc.EngineCoreProc` binds the socket and hands it to an
`InputThread`, which from then on is its only user (and closes it). It decodes and validates
each message (`vconsole.wire.protocol`) off the compute path and puts what it read on
the busy loop's queue (`vconsole.engine.process.loop_inputs`): ``add`` and ``abort``, and a
data-parallel front end's ``start_wave`` / ``regroup`` as the process's role reads them
(`vconsole.engine.process.process_role`). A ``hello`` goes straight to the output thread, which answers
it. A malformed message is answered with its reason and never reaches the core: through the
busy loop when it names a request (only the loop knows whether that one is in flight), else
directly as an ``error``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from vconsole.engine.process.loop_inputs import Abort, Add, LoopInput, Reject
from vconsole.engine.process.output_items import Error, Hello, OutputItem
from vconsole.engine.process.process_role import ProcessRole
from vconsole.shared.config import EngineConfig
from vconsole.wire import protocol

log = logging.getLogger("vconsole.engine")


class InputThread(threading.Thread):
    """Owns the input socket from `start` on; see the module docstring. ``config``: the
    busy loop's last published config (prompt limits); ``max_model_len``: the model's."""

    def __init__(self, sock: zmq.Socket, *, inputs: queue.SimpleQueue[LoopInput],
                 outputs: queue.SimpleQueue[OutputItem], config: Callable[[], EngineConfig],
                 max_model_len: int | None, role: ProcessRole, stop: threading.Event,
                 poll_ms: int) -> None:
        super().__init__(name="engine-input", daemon=True)
        self.sock = sock
        self._inputs = inputs
        self._outputs = outputs
        self._config = config
        self._max_prompt_tokens = max_model_len - 1 if max_model_len else None
        self._role = role
        self._halt = stop          # not `_stop`: a Thread method
        self._poll_ms = poll_ms

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if self.sock.poll(self._poll_ms):
                    self.on_message(self.sock.recv_multipart(copy=False))
        finally:
            self.sock.close()

    def on_message(self, frames: list[zmq.Frame]) -> None:
        client_id = frames[0].bytes
        try:
            header = protocol.decode([f.buffer for f in frames[1:]])
            kind = header["type"]
            if kind == protocol.ADD:
                msg = protocol.parse_add(header, max_prompt_chars=self._config().max_prompt_chars,
                                         max_prompt_tokens=self._max_prompt_tokens)
                self._inputs.put(Add(client_id, msg))
            elif kind == protocol.ABORT:
                self._inputs.put(Abort(client_id, protocol.parse_abort(header)))
            elif kind == protocol.HELLO:
                self._outputs.put(Hello(client_id))
            elif kind in (protocol.START_WAVE, protocol.REGROUP):
                self._inputs.put(self._role.front_end_input(kind, header))
            else:
                raise protocol.ProtocolError(f"unknown message type {kind!r}",
                                             protocol.request_id_of(header))
        except protocol.ProtocolError as e:
            log.warning("rejected a message from client %s: %s",
                        client_id.decode(errors="replace"), e.reason)
            if e.request_id is not None:    # the busy loop knows whether it is in flight
                self._inputs.put(Reject(client_id, e.request_id, e.reason))
            else:
                self._outputs.put(Error(client_id, e.reason, None, False))
