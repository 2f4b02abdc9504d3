"""Requests in, outputs out: the busy loop's side of the clients' requests.

Every message that names a request gets that request's final output, and exactly one — unless
the request it names is in flight, which goes on (an ``error`` with ``in_flight`` tells the
client so). A client's request id becomes an engine id (`RequestRegistry`: unique engine-wide,
so two clients may use the same id); outputs go back under the client's own id. Long text
prompts are tokenized off the loop (a small thread pool) and come back as
`vconsole.engine.process.loop_inputs.AddReady`; a request aborted or left by its client meanwhile
is answered at once and its late result dropped.

A finished output's ``text`` is not made here: the request's output token ids travel with it
to the output thread, which detokenizes just before sending (`output_items.Outputs`), so the
busy loop never decodes.

Used by the busy loop's thread only (the pool's threads only tokenize and enqueue).
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor

from vconsole.engine.process.loop_inputs import AddReady, LoopInput
from vconsole.engine.process.output_items import Error, OutputItem, Outputs
from vconsole.engine.process.request_registry import RequestRegistry
from vconsole.engine.process.serving_core import ServingCore
from vconsole.engine.request import FinishReason, Request
from vconsole.wire import protocol
from vconsole.wire.outputs import RequestOutput

log = logging.getLogger("vconsole.engine")

INLINE_PROMPT_CHARS = 2048  # longer text prompts are tokenized off the busy loop
PREPARE_WORKERS = 2         # threads that tokenize and validate long prompts


class RequestIntake:
    """``core``: the engine core (make, add and abort requests); ``input_queue``: where
    prepared requests come back; ``output_queue``: the output thread's."""

    def __init__(self, core: ServingCore, input_queue: queue.SimpleQueue[LoopInput],
                 output_queue: queue.SimpleQueue[OutputItem]) -> None:
        self.core = core
        self.input_queue = input_queue
        self.output_queue = output_queue
        self.requests = RequestRegistry()       # engine id <-> (client, its id)
        self._in_core: dict[str, Request] = {}  # engine id -> request, while the core has it
        self._preparing: set[str] = set()       # engine ids being tokenized off the loop
        self._pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="engine-prepare")

    # --- in ---------------------------------------------------------------------------------

    def add(self, client_id: bytes, msg: protocol.AddMessage, refuse: str | None = None) -> None:
        """A client's ``add``; ``refuse``: why it is refused outright (shutting down)."""
        if refuse:
            return self._reject(client_id, msg.request_id, refuse)
        engine_id = self.requests.open(client_id, msg.request_id)
        if engine_id is None:
            self.output_queue.put(Error(client_id, f"duplicate request id {msg.request_id!r}: "
                                        "one is in flight (it goes on)", msg.request_id, True))
            return
        if msg.prompt is not None and len(msg.prompt) > INLINE_PROMPT_CHARS:
            self._preparing.add(engine_id)
            self._pool.submit(self._prepare_off_loop, engine_id, client_id, msg)
        else:
            self._admit(engine_id, client_id, self._make_request(engine_id, client_id, msg))

    def add_ready(self, engine_id: str, client_id: bytes, result: Request | str) -> None:
        """A request tokenized off the loop is back."""
        if engine_id not in self._preparing:
            return  # aborted, or its client left, while it was prepared: already answered
        self._preparing.discard(engine_id)
        self._admit(engine_id, client_id, result)

    def reject_message(self, client_id: bytes, request_id: str, reason: str) -> None:
        """A message naming ``request_id`` that could not be read (from the input thread)."""
        if self.requests.lookup(client_id, request_id) is not None:
            self.output_queue.put(Error(client_id, reason, request_id, True))
        else:
            self._reject(client_id, request_id, reason)

    def abort(self, client_id: bytes, request_ids: list[str]) -> None:
        """A client aborts some of its own requests (others' ids are not found)."""
        self._abort_engine_ids([eid for rid in request_ids
                                if (eid := self.requests.lookup(client_id, rid)) is not None])

    def client_gone(self, client_id: bytes) -> None:
        ids = self.requests.of_client(client_id)
        if ids:
            log.warning(
                "client %s is gone: aborting its %d request(s)",
                client_id.decode(errors="replace"), len(ids))
            self._abort_engine_ids(ids)

    def abort_all(self) -> None:
        """Shutdown: abort every request in flight and stop preparing."""
        self._abort_engine_ids(self.requests.engine_ids())
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- out --------------------------------------------------------------------------------

    def emit(self, outputs: dict[bytes, list[RequestOutput]]) -> None:
        """Send outputs keyed by engine id to their clients, under the clients' own ids; a
        finished one of a request the core ran goes with its output token ids, for its text."""
        for client_id, outs in outputs.items():
            to_detokenize: list[tuple[RequestOutput, list[int]]] = []
            for out in outs:
                owner = self.requests.owner(out.request_id)
                if owner is None:
                    continue  # not a client's request (cannot happen; never mis-deliver)
                if out.finished:
                    self.requests.close(out.request_id)
                    req = self._in_core.pop(out.request_id, None)
                    if req is not None and out.text is None:
                        to_detokenize.append((out, list(req.output_token_ids)))
                out.request_id = owner[1]
            self.output_queue.put(Outputs(client_id, outs, to_detokenize))

    # --- inside -----------------------------------------------------------------------------

    def _reject(self, client_id: bytes, request_id: str, reason: str) -> None:
        """The final output of a request that never got an engine id."""
        self.output_queue.put(Outputs(client_id, [RequestOutput(
            request_id, finished=True, finish_reason=FinishReason.ERROR.value, error=reason)]))

    def _finish_unqueued(self, engine_id: str, reason: FinishReason, error: str | None) -> None:
        """The final output of a request that has an engine id but never reached the core."""
        owner = self.requests.owner(engine_id)
        if owner is not None:
            self.emit({owner[0]: [RequestOutput(engine_id, finished=True,
                                                finish_reason=reason.value, error=error)]})

    def _make_request(self, engine_id: str, client_id: bytes,
                      msg: protocol.AddMessage) -> Request | str:
        """Tokenize and validate: the Request, or why it was refused. Thread-safe (the core's
        tokenizer and limits are only read)."""
        try:
            return self.core.make_request(engine_id, prompt=msg.prompt,
                                          prompt_token_ids=msg.prompt_token_ids,
                                          sampling=msg.sampling, priority=msg.priority,
                                          client_id=client_id)
        except ValueError as e:
            return str(e)
        except Exception as e:  # a tokenizer failure must cost this request only
            return f"could not prepare the request: {type(e).__name__}: {e}"

    def _prepare_off_loop(self, engine_id: str, client_id: bytes,
                          msg: protocol.AddMessage) -> None:
        self.input_queue.put(AddReady(engine_id, client_id,
                                      self._make_request(engine_id, client_id, msg)))

    def _admit(self, engine_id: str, client_id: bytes, result: Request | str) -> None:
        if isinstance(result, str):
            return self._finish_unqueued(engine_id, FinishReason.ERROR, result)
        rejected = self.core.add_request(result)
        if rejected is not None:
            self.emit({client_id: [rejected]})
        else:
            self._in_core[engine_id] = result

    def _abort_engine_ids(self, engine_ids: list[str]) -> None:
        in_core = []
        for eid in engine_ids:
            if eid in self._preparing:
                self._preparing.discard(eid)
                self._finish_unqueued(eid, FinishReason.ABORT, None)
            else:
                in_core.append(eid)
        if in_core:
            self.core.abort_requests(in_core)
