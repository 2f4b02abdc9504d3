"""EngineLink: the HTTP server's one connection to the engine process, and its samples.

One `AsyncEngineClient` (the engine's own ZeroMQ protocol) serves every HTTP request; the
server runs in its own process, never on the engine's busy loop, so it fronts a lone engine or a
data-parallel group's front end alike. `samples` runs the ``n`` samples of one prompt as ``n``
engine requests (the engine's prefix cache shares the prompt's KV blocks between them) and
yields their outputs as they come, merged; leaving the iterator early (a stop string, a client
that went away) aborts in the engine whatever is still running.

``connected``: the engine answered its handshake, its connection has not closed since (a killed
engine's does at once: requests in flight fail that moment, see `AsyncEngineClient`) and it has
not gone silent (ten heartbeats: an engine alive but stopped). Once not connected, the server
shakes hands again (``_keep_connected``) with the engine the supervisor restarts; until then
every new request is refused at once with a 503 (`check_reachable`, before a stream's headers
go out), never left to wait for that handshake. ``healthy``
(``GET /health``) is stricter: also heard within the last three heartbeats, the rule by which
the console shows ENGINE DOWN. ``in_flight``: engine requests running
for HTTP clients (``GET /load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.client.client import ENGINE_UNREACHABLE
from vconsole.entrypoints.openai.protocol import BadRequest
from vconsole.security.curve import ClientCurve
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.protocol import SHUTTING_DOWN

HEALTH_INTERVALS = 3   # heartbeats of silence after which /health says 503 (the console's rule)


def engine_refusal(reason: str) -> BadRequest:
    """The HTTP error for a request the engine ended with an error: 503 when the engine is
    gone or leaving (the client may retry elsewhere or later), else 400 (the engine's own
    validation refused what the client sent)."""
    if reason.startswith((ENGINE_UNREACHABLE, SHUTTING_DOWN)):
        return BadRequest(reason, status=503, kind="ServiceUnavailableError")
    return BadRequest(reason)


class EngineLink:
    def __init__(self, input_endpoint: str, output_endpoint: str, *,
                 timeout_s: float = 10.0, curve: ClientCurve | None = None) -> None:
        self.client = AsyncEngineClient(input_endpoint, output_endpoint, timeout_s=timeout_s,
                                        curve=curve)
        self.in_flight = 0
        self._live: set[str] = set()      # engine ids of the samples running now
        self._ids = itertools.count()
        self._info: dict[str, Any] = {}

    @property
    def info(self) -> dict[str, Any]:
        """What the engine said at its last handshake (vocab_size, max_model_len, model, ...),
        kept while it restarts (the client forgets it at a disconnect)."""
        if self.client.engine_info:
            self._info = self.client.engine_info
        return self._info

    def check_reachable(self) -> None:
        """`BadRequest` 503 unless the engine is connected now: a request it cannot reach is
        refused at once, not after a handshake's timeout (the server is already shaking hands
        again in the background, ``_keep_connected``)."""
        if not self.client.connected:
            raise BadRequest(f"{ENGINE_UNREACHABLE}: no engine is connected at "
                             f"{self.client.input_endpoint} (it stopped, died or is restarting; "
                             "GET /health says 200 once it is back)", status=503,
                             kind="ServiceUnavailableError")

    @property
    def connected(self) -> bool:
        return self.client.connected

    @property
    def healthy(self) -> bool:
        c = self.client
        return c.connected and time.monotonic() - c.last_message <= HEALTH_INTERVALS * c.heartbeat_s

    async def connect(self) -> None:
        await self.client.connect()

    async def reconnect(self) -> None:
        await self.client.reconnect()

    async def close(self) -> None:
        await self.client.close()

    def new_id(self, kind: str, given: str | None = None) -> str:
        """An engine request id: the client's ``x-request-id`` (so the console shows the id
        the application knows), made unique if one with that id is still running; else a
        random one, ``cmpl-<uuid hex>`` as vLLM's (the response's ``id`` too: nobody can
        guess another client's ids)."""
        if not given:
            return f"{kind}-{uuid.uuid4().hex}"
        if given in self._live or any(k.startswith(given + "-") for k in self._live):
            return f"{given}-{next(self._ids)}"
        return given

    async def samples(self, request_id: str, prompt_token_ids: Sequence[int],
                      sampling: Sequence[dict[str, Any]], priority: int = 0, *,
                      stopped: set[int] | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sample index, output) for each engine output of the ``len(sampling)`` samples of
        one prompt, in arrival order, until every sample finished. A sample the caller adds to
        ``stopped`` (a stop string) is aborted in the engine at once and counts as finished."""
        ids: list[str] = []
        try:
            for i, params in enumerate(sampling):
                self.check_reachable()      # it may have died since the request came in
                sample_id = request_id if len(sampling) == 1 else f"{request_id}-{i}"
                self._live.add(sample_id)
                ids.append(sample_id)
                self.in_flight += 1
                await self.client.submit(prompt_token_ids=prompt_token_ids,
                                         request_id=sample_id, priority=priority, **params)
            if len(ids) == 1:                # one sample: no fan-in needed
                async for out in self.client.stream(ids[0], merge=True):
                    if out.finished:
                        self.in_flight -= 1
                        ids[0] = ""
                    yield 0, out
                    if ids[0] and stopped:       # a stop string: abort it in the engine now
                        await self.client.abort([ids[0]])
                        self.in_flight -= 1
                        ids[0] = ""
                        return
                return
            queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

            async def pump(i: int, rid: str) -> None:
                async for out in self.client.stream(rid, merge=True):
                    await queue.put((i, out))

            pumps = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(ids)]
            try:
                running = len(ids)
                while running:
                    i, out = await queue.get()
                    if not ids[i]:
                        continue                  # stopped here; this is the abort's echo
                    if out.finished:
                        running -= 1
                        self.in_flight -= 1
                        ids[i] = ""
                    yield i, out
                    for j in stopped or ():
                        if ids[j]:
                            await self.client.abort([ids[j]])
                            running -= 1
                            self.in_flight -= 1
                            ids[j] = ""
            finally:
                for task in pumps:
                    task.cancel()
        finally:
            self._live.difference_update(f"{request_id}-{i}" if len(sampling) > 1
                                         else request_id for i in range(len(sampling)))
            left = [rid for rid in ids if rid]
            self.in_flight -= len(left)
            if left:
                with contextlib.suppress(Exception):
                    await self.client.abort(left)
