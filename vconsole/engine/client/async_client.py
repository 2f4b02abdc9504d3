"""`AsyncEngineClient`: the asyncio client of the engine process.

One reader task routes outputs into a queue per request, so any number of tasks can each await
their own request's stream; a watchdog task applies the liveness and processing timeouts; a
monitor task watches the output socket's connection (ZeroMQ's socket monitor): when the engine's
process ends, its connection closes and every request in flight fails at once (``engine
unreachable: the connection ... closed``), not after ``liveness_intervals`` silent heartbeats
(ten seconds by default), and ``connected`` turns False so the caller shakes hands again with
the engine its supervisor restarts. What the engine sent before it closed is routed first. The
handshake, frames and timeouts are `ClientBase`'s (`vconsole.engine.client.client`), shared with
the blocking `EngineClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vconsole.engine.client.client import (
    DEFAULT_TIMEOUT_S,
    ENGINE_UNREACHABLE,
    LIVENESS_INTERVALS,
    ClientBase,
    Completion,
    no_engine_error,
)
from vconsole.security.curve import ClientCurve
from vconsole.security.endpoints import DEFAULT_INPUT, DEFAULT_OUTPUT
from vconsole.wire import protocol
from vconsole.wire.outputs import RequestOutput

SETTLE_S = 0.02          # after a disconnect: how often to look whether the reader has caught up
SETTLE_ROUNDS = 25       # ... and at most how often (0.5 s) before failing what is left


async def drain_request(queues: dict[str, asyncio.Queue[RequestOutput]],
                        request_id: str, *, merge: bool = False
                        ) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to and including its final one; the queue is
    forgotten after (finished, or the caller stopped reading). ``merge``: outputs that queued
    up while the caller was busy come as one (`RequestOutput.merged`), so a slow consumer
    does one round of work per wake-up, not one per token."""
    queue = queues[request_id]
    try:
        while True:
            out = await queue.get()
            while merge and not out.finished and not queue.empty():
                out = out.merged(queue.get_nowait())
            yield out
            if out.finished:
                return
    finally:
        queues.pop(request_id, None)


class AsyncEngineClient(ClientBase):
    """asyncio client: one reader task routes outputs into a queue per request, so any number
    of tasks can each await their own request's stream."""

    def __init__(self, input_endpoint: str = DEFAULT_INPUT, output_endpoint: str = DEFAULT_OUTPUT,
                 *, timeout_s: float = DEFAULT_TIMEOUT_S, client_id: bytes | None = None,
                 curve: ClientCurve | None = None, liveness_intervals: float = LIVENESS_INTERVALS,
                 request_timeout_s: float | None = None) -> None:
        super().__init__(input_endpoint, output_endpoint, timeout_s, client_id, curve,
                         liveness_intervals, request_timeout_s)
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._in = self._ctx.socket(zmq.DEALER)
        self._out = self._ctx.socket(zmq.DEALER)
        self._configure(self._in, self._out)
        self._monitor = self._out.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def connect(self) -> AsyncEngineClient:
        """Handshake with the engine; `TimeoutError` if none answers within ``timeout_s``."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop())
            self._watchdog = asyncio.create_task(self._watch_loop())
            self._watcher = asyncio.create_task(self._connection_loop())
        await self._in.send_multipart(protocol.encode_hello(), copy=False)
        try:
            await asyncio.wait_for(self._ready.wait(), self.timeout_s)
        except TimeoutError:
            raise no_engine_error(self.input_endpoint, self.output_endpoint, self.timeout_s) from None
        return self

    @property
    def connected(self) -> bool:
        """The engine answered the handshake, has not gone silent with requests in flight
        since, and its heartbeats still come (an idle client hears them too)."""
        return self._ready.is_set() and \
            time.monotonic() - self.last_message <= self.liveness_s

    async def reconnect(self) -> AsyncEngineClient:
        """A new handshake (an engine that restarted answers it; `TimeoutError` if none)."""
        self._disconnected()
        return await self.connect()

    def _disconnected(self) -> None:
        super()._disconnected()
        self._ready.clear()

    async def _watch_loop(self) -> None:
        """Finish requests the engine will not answer (silence, or request_timeout_s)."""
        while True:
            await asyncio.sleep(self._tick_s())
            outs, to_abort = self._check_timeouts(self._queues.keys())
            if to_abort:
                await self.abort(to_abort)
            self._put(outs)

    async def _connection_loop(self) -> None:
        """Fail every request in flight as soon as the engine's connection closes (its
        process ended: killed, crashed or stopped), not after the silent heartbeats."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            await self._settle()
            self._put(self._engine_gone(list(self._queues), (
                f"{ENGINE_UNREACHABLE}: the connection to {self.output_endpoint} closed (the "
                "engine process stopped or died)")))

    async def _settle(self) -> None:
        """Let the reader route what the engine sent before its connection closed (it is
        already in this process), so that only requests it never finished fail."""
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(SETTLE_S)
            if not cast(int, self._out.get(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _put(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def __aenter__(self) -> AsyncEngineClient:
        try:
            return await self.connect()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._reader, self._watchdog, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reader = self._watchdog = self._watcher = None
        self._out.disable_monitor()
        self._monitor.close(0)
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()

    async def _read_loop(self) -> None:
        while True:
            frames = await self._out.recv_multipart(copy=False)
            if (handled := self._handle_or_note(frames)) is None:
                continue
            outs, to_abort = handled
            if to_abort:
                await self.abort(to_abort)
            if self.engine_info:
                self._ready.set()
            self._put(outs)

    async def submit(self, prompt: str | None = None, *,
                     prompt_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                     priority: int = 0, **sampling: Any) -> str:
        if not self._ready.is_set():
            await self.connect()  # a new handshake after the engine went silent
        rid, frames = self._add_frames(prompt, prompt_token_ids, request_id, priority, sampling)
        self._queues[rid] = asyncio.Queue()
        self._submitted(rid)
        await self._in.send_multipart(frames, copy=False)
        return rid

    def _in_flight_ids(self) -> Iterable[str]:
        return self._queues.keys()

    def stream(self, request_id: str, *, merge: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs until its final one (``merge``: see `drain_request`)."""
        return drain_request(self._queues, request_id, merge=merge)

    async def generate_stream(self, prompt: str | None = None, *,
                              prompt_token_ids: Sequence[int] | None = None, priority: int = 0,
                              **sampling: Any) -> AsyncIterator[RequestOutput]:
        rid = await self.submit(prompt, prompt_token_ids=prompt_token_ids, priority=priority,
                                **sampling)
        async for out in self.stream(rid):
            yield out

    async def generate(self, prompt: str | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None, priority: int = 0,
                       **sampling: Any) -> Completion:
        rid = await self.submit(prompt, prompt_token_ids=prompt_token_ids, priority=priority,
                                **sampling)
        done = Completion(rid)
        async for out in self.stream(rid):
            done.add(out)
        return done

    async def abort(self, request_ids: Iterable[str]) -> None:
        await self._in.send_multipart(protocol.encode_abort(request_ids), copy=False)
