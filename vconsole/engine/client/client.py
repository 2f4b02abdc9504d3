"""Clients of the engine process: `EngineClient` (blocking) here, `AsyncEngineClient` (asyncio) in
`vconsole.engine.client.async_client`; both share `ClientBase` (handshake, frames, timeouts).

Socket design (see `vconsole.engine.process.core_proc`): a client owns two DEALER sockets with the same routing
identity, its *client id*. It sends requests on the input DEALER (the engine's input ROUTER reads
the identity) and receives outputs on the output DEALER (the engine's output ROUTER addresses it
by that identity). `connect` sends ``hello`` on the input socket and waits for ``ready`` on the
output socket: only then is the engine known to be up *and* able to route outputs back, so no
output can be lost to a half-made connection, and a missing engine is a clear `TimeoutError`.
With ``curve`` (`vconsole.security.curve.ClientCurve`, needed by an engine started with CURVE
keys) both sockets are CURVE clients; an engine that does not authorise the key pair never
completes the handshake, so that too is the `TimeoutError` of `connect`.

Requests from one client may be in flight in any number; outputs of different requests arrive
interleaved and are sorted per request. Request ids are scoped per client at the engine (two
clients may use the same ids); they default to ``<client id>-<n>``, and reusing an id this client
has in flight is a `ValueError` at ``submit``. An id the engine would refuse (not a string of 1..`protocol.MAX_REQUEST_ID_LEN` characters) is a `ValueError` at
``submit``, before anything is sent.

An ``error`` from the engine that names no request (a message it could not even attribute) means
one of this client's messages was dropped and nobody can tell which: every request still waiting
for its first output is then failed (a final output with finish_reason ``error`` and the engine's
reason) and aborted at the engine, so no caller waits forever for an answer that will not come.

Two timeouts keep a caller from waiting forever (the seed's double timeout):
- **liveness**: the engine sends a ``heartbeat`` to every handshaken client each
  ``heartbeat_interval_s`` (announced in ``ready``). A client that hears nothing at all for
  ``liveness_intervals`` intervals while requests are in flight fails every one of them with
  finish_reason ``error`` and ``engine unreachable: ...``, and handshakes again (``hello``) before
  its next request, so it reconnects to an engine that was restarted on the same endpoints.
- **a closed connection** (`AsyncEngineClient`): when the engine's process ends (``kill -9``,
  a crash, a stop) its sockets close and ZeroMQ reports the disconnect at once; every request in
  flight then fails the same way (``engine unreachable: the connection ... closed``) without
  waiting for the silent heartbeats. An engine that is alive but silent (stopped, swapping)
  keeps its connection and is judged by the liveness rule above.
- **processing**: with ``request_timeout_s`` a request without its final output after that long
  is aborted at the engine and finished locally with finish_reason ``timeout``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from vconsole.security.curve import ClientCurve
from vconsole.security.endpoints import DEFAULT_INPUT, DEFAULT_OUTPUT
from vconsole.wire import protocol
from vconsole.wire.outputs import PromptLogprobs, RequestOutput

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class Completion:
    """A finished request as the client saw it: every output token, in order."""

    request_id: str
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finished: bool = False
    logprobs: list[tuple[float, list[int], list[float]]] | None = None  # one per output token
    prompt_logprobs: PromptLogprobs | None = None   # when asked (with the first output)

    def add(self, out: RequestOutput) -> None:
        self.output_token_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_preemptions = out.num_preemptions
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.text = out.text
            self.error = out.error


class EngineError(RuntimeError):
    """The engine refused a whole message (not one request): a protocol error."""


def new_client_id() -> bytes:
    """A routing identity: printable, never starting with a zero byte (reserved by ZeroMQ)."""
    return b"c" + os.urandom(6).hex().encode()


def _sampling(kw: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kw) - set(protocol.SAMPLING_KEYS))
    if unknown:
        raise TypeError(f"unknown sampling arguments: {', '.join(unknown)}")
    return {k: (list(v) if k == "stop_token_ids" else v) for k, v in kw.items() if v is not None}


def no_engine_error(input_endpoint: str, output_endpoint: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"no engine answered at input={input_endpoint} output={output_endpoint} "
                        f"within {timeout_s:g}s (is `vconsole engine` running there? An engine "
                        "with CURVE keys answers only clients holding an authorised key pair "
                        "and its server public key)")


def _ready_info(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if k not in ("v", "type")}


DEFAULT_HEARTBEAT_S = 1.0   # until the engine's ready says otherwise
LIVENESS_INTERVALS = 10
ENGINE_UNREACHABLE = "engine unreachable"


class ClientBase:
    def __init__(self, input_endpoint: str, output_endpoint: str, timeout_s: float,
                 client_id: bytes | None, curve: ClientCurve | None = None,
                 liveness_intervals: float = LIVENESS_INTERVALS,
                 request_timeout_s: float | None = None) -> None:
        self.curve = curve
        self.liveness_intervals = liveness_intervals
        self.request_timeout_s = request_timeout_s
        self.num_unreachable = 0                 # times the engine went silent
        self._last_heard = time.monotonic()
        self.last_message = time.monotonic()     # when the engine last said anything
        self._deadlines: dict[str, float] = {}   # request id -> processing deadline
        self.input_endpoint = input_endpoint
        self.output_endpoint = output_endpoint
        self.timeout_s = timeout_s
        self.client_id = client_id or new_client_id()
        self.engine_info: dict[str, Any] = {}
        self.protocol_errors: list[str] = []
        self._seq = 0
        self._unanswered: set[str] = set()   # submitted, no output yet

    def _configure(self, in_sock: zmq.Socket, out_sock: zmq.Socket) -> None:
        for sock in (in_sock, out_sock):
            sock.setsockopt(zmq.IDENTITY, self.client_id)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve.apply(sock)
        # Unbounded receive queue: a slow reader must never make the engine think it is gone.
        out_sock.setsockopt(zmq.RCVHWM, 0)
        out_sock.connect(self.output_endpoint)
        in_sock.connect(self.input_endpoint)

    def _add_frames(self, prompt: str | None, prompt_token_ids: Sequence[int] | np.ndarray | None,
                    request_id: str | None, priority: int, sampling: dict[str, Any]
                    ) -> tuple[str, protocol.Frames]:
        if request_id is None:
            self._seq += 1
            request_id = f"{self.client_id.decode()}-{self._seq}"
        elif request_id in self._unanswered or request_id in self._in_flight_ids():
            raise ValueError(f"request id {request_id!r} is in flight on this client")
        frames = protocol.encode_add(request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                     sampling=_sampling(sampling), priority=priority)
        return request_id, frames

    def _in_flight_ids(self) -> Iterable[str]:
        raise NotImplementedError

    @property
    def heartbeat_s(self) -> float:
        return float(self.engine_info.get("heartbeat_interval_s") or DEFAULT_HEARTBEAT_S)

    @property
    def liveness_s(self) -> float:
        """Silence after which the engine counts as unreachable."""
        return self.liveness_intervals * self.heartbeat_s

    def _tick_s(self) -> float:
        """How often a waiting client checks liveness and deadlines."""
        return min(0.25, self.heartbeat_s / 2)

    def _submitted(self, request_id: str) -> None:
        self._unanswered.add(request_id)
        if self.request_timeout_s is not None:
            self._deadlines[request_id] = time.monotonic() + self.request_timeout_s

    def _check_timeouts(self, in_flight: Iterable[str]) -> tuple[list[RequestOutput], list[str]]:
        """Final outputs for requests the engine will not answer: all of them when it has
        been silent too long, else those past their processing deadline (to abort)."""
        ids = list(in_flight)
        if not ids:
            self._last_heard = max(self._last_heard, time.monotonic() - self.liveness_s / 2)
            return [], []
        now = time.monotonic()
        silent = now - self._last_heard
        if silent > self.liveness_s:
            return self._engine_gone(ids, (
                f"{ENGINE_UNREACHABLE}: nothing heard from {self.output_endpoint} for "
                f"{silent:.1f} s (heartbeats every {self.heartbeat_s:g} s)")), []
        expired = [rid for rid in ids if self._deadlines.get(rid, now + 1) <= now]
        for rid in expired:
            self._unanswered.discard(rid)
            del self._deadlines[rid]
        return [RequestOutput(rid, finished=True, finish_reason="timeout",
                              error=f"no final output within request_timeout_s "
                                    f"{self.request_timeout_s:g} s; aborted")
                for rid in expired], expired

    def _engine_gone(self, in_flight: Iterable[str], reason: str) -> list[RequestOutput]:
        """The engine will answer none of ``in_flight``: their final outputs (finish_reason
        ``error``, ``reason``); the next request shakes hands again."""
        self.num_unreachable += 1
        self._disconnected()
        return [RequestOutput(rid, finished=True, finish_reason="error", error=reason)
                for rid in in_flight]

    def _disconnected(self) -> None:
        """Forget the engine: the next request starts with a new handshake."""
        self.engine_info = {}
        self._unanswered.clear()
        self._deadlines.clear()

    def _handle(self, frames: list[Any]) -> tuple[list[RequestOutput], list[str]]:
        """One engine message -> (outputs to route, request ids to abort at the engine)."""
        self._last_heard = self.last_message = time.monotonic()
        header = protocol.decode([f.buffer if isinstance(f, zmq.Frame) else f for f in frames])
        kind = header["type"]
        if kind == protocol.OUTPUTS:
            outs = protocol.parse_outputs(header)
            for out in outs:
                self._unanswered.discard(out.request_id)
                if out.finished:
                    self._deadlines.pop(out.request_id, None)
            return outs, []
        if kind == protocol.ERROR:
            rid = header.get("request_id")
            reason = str(header.get("reason"))
            if rid and header.get("in_flight") is True:
                self.protocol_errors.append(reason)  # that request goes on
                return [], []
            if rid:
                self._unanswered.discard(rid)
                return [RequestOutput(rid, finished=True, finish_reason="error",
                                      error=reason)], []
            self.protocol_errors.append(reason)
            return self._fail_unanswered(reason)
        if kind == protocol.READY:
            self.engine_info = _ready_info(header)
        return [], []

    def _handle_or_note(self, frames: list[Any]
                        ) -> tuple[list[RequestOutput], list[str]] | None:
        """`_handle`, or None for frames that break the protocol (kept in ``protocol_errors``;
        the client reads on)."""
        try:
            return self._handle(frames)
        except protocol.ProtocolError as e:
            self.protocol_errors.append(str(e))
            return None

    def _fail_unanswered(self, reason: str) -> tuple[list[RequestOutput], list[str]]:
        """The engine dropped one of our messages without naming its request: fail every
        request that could be that one (no output yet), and abort them in case it was not."""
        ids = sorted(self._unanswered)
        self._unanswered.clear()
        why = (f"the engine rejected a message it could not attribute to a request: {reason} "
               "(this request had no answer yet, so it may have been that message)")
        return [RequestOutput(rid, finished=True, finish_reason="error", error=why)
                for rid in ids], ids


class EngineClient(ClientBase):
    """Blocking client. Not thread-safe: use it from one thread (or one client per thread).

    >>> with EngineClient() as c:
    ...     done = c.generate("Hello", max_tokens=8)
    """

    def __init__(self, input_endpoint: str = DEFAULT_INPUT, output_endpoint: str = DEFAULT_OUTPUT,
                 *, timeout_s: float = DEFAULT_TIMEOUT_S, client_id: bytes | None = None,
                 curve: ClientCurve | None = None, liveness_intervals: float = LIVENESS_INTERVALS,
                 request_timeout_s: float | None = None) -> None:
        super().__init__(input_endpoint, output_endpoint, timeout_s, client_id, curve,
                         liveness_intervals, request_timeout_s)
        self._ctx = zmq.Context(io_threads=1)
        self._in = self._ctx.socket(zmq.DEALER)
        self._out = self._ctx.socket(zmq.DEALER)
        self._configure(self._in, self._out)
        self._pending: dict[str, deque[RequestOutput]] = {}
        self._connected = False

    def connect(self) -> EngineClient:
        """Handshake with the engine; `TimeoutError` if none answers within ``timeout_s``."""
        self._in.send_multipart(protocol.encode_hello(), copy=False)
        deadline = time.monotonic() + self.timeout_s
        while not self.engine_info:
            left = deadline - time.monotonic()
            if left <= 0 or not self._out.poll(int(left * 1000)):
                raise no_engine_error(self.input_endpoint, self.output_endpoint, self.timeout_s)
            self._route(self._out.recv_multipart(copy=False))
        self._connected = True
        return self

    def __enter__(self) -> EngineClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()

    def submit(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
               request_id: str | None = None, priority: int = 0, **sampling: Any) -> str:
        """Send one request; returns its id. ``sampling``: SamplingParams fields."""
        if not self._connected:
            self.connect()
        rid, frames = self._add_frames(prompt, prompt_token_ids, request_id, priority, sampling)
        self._pending[rid] = deque()
        self._submitted(rid)
        self._in.send_multipart(frames, copy=False)
        return rid

    def abort(self, request_ids: Iterable[str]) -> None:
        """Their final outputs (finish_reason ``abort``) still arrive through the stream."""
        self._in.send_multipart(protocol.encode_abort(request_ids), copy=False)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def _in_flight_ids(self) -> Iterable[str]:
        return self._pending.keys()

    def _disconnected(self) -> None:
        super()._disconnected()
        self._connected = False

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.request_id in self._pending:
                self._pending[out.request_id].append(out)

    def _route(self, frames: list[Any]) -> None:
        if (handled := self._handle_or_note(frames)) is None:
            return
        outs, to_abort = handled
        if to_abort:
            self.abort(to_abort)
        self._deliver(outs)

    def _receive(self, deadline: float | None) -> None:
        """Wait for the next engine message (or for a timeout to finish requests locally);
        `TimeoutError` at ``deadline``."""
        while True:
            wait = self._tick_s()
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            received = self._out.poll(int(wait * 1000))   # ms, as pyzmq truncates a float
            if received:
                self._route(self._out.recv_multipart(copy=False))
                while self._out.poll(0):
                    self._route(self._out.recv_multipart(copy=False))
            outs, to_abort = self._check_timeouts(
                rid for rid, q in self._pending.items() if not (q and q[-1].finished))
            if to_abort:
                self.abort(to_abort)
            self._deliver(outs)
            if received or outs:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("no output from the engine before the deadline")

    def _take_buffered(self, request_id: str) -> Iterator[RequestOutput]:
        """Yield the outputs of ``request_id`` received so far; at its final one the request
        leaves ``_pending``."""
        queue = self._pending[request_id]
        while queue:
            out = queue.popleft()
            if out.finished:
                del self._pending[request_id]
            yield out
            if out.finished:
                return

    def stream(self, request_id: str, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs (token deltas, then the final one) as they arrive,
        buffering other requests' outputs meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            yield from self._take_buffered(request_id)
            if request_id not in self._pending:
                return
            self._receive(deadline)

    def outputs(self, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """Yield every in-flight request's outputs in arrival order until none is in flight."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending:
            for rid in list(self._pending):
                yield from self._take_buffered(rid)
            if self._pending and not any(self._pending.values()):
                self._receive(deadline)

    def gather(self, request_ids: Iterable[str] | None = None,
               timeout_s: float | None = None) -> dict[str, Completion]:
        """Wait for requests (default: all in flight) and return their completions."""
        ids = list(self._pending if request_ids is None else request_ids)
        results = {rid: Completion(rid) for rid in ids}
        for out in self.outputs(timeout_s):
            if out.request_id in results:
                results[out.request_id].add(out)
            if all(c.finished for c in results.values()):
                break
        return results

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                 priority: int = 0, timeout_s: float | None = None, **sampling: Any) -> Completion:
        """Submit one request and wait for its final output."""
        rid = self.submit(prompt, prompt_token_ids=prompt_token_ids, priority=priority, **sampling)
        done = Completion(rid)
        for out in self.stream(rid, timeout_s):
            done.add(out)
        return done
