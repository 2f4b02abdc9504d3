"""HttpLoadClient: `vconsole load --api-url URL` sends its workload to an OpenAI-compatible
server instead of the engine's own socket.

It has the three calls `vconsole.tools.loadgen.run_load` makes of an engine client (``submit``,
``stream``, ``abort``) and ``engine_info``, so the same workload, rate, concurrency and summary
serve both. Each request is what `vllm bench serve` sends (over `vconsole.tools.sse_client`, plain
asyncio HTTP as its aiohttp: no SDK parsing in the measurement): a streaming ``/v1/completions`` with the
prompt as token ids, ``ignore_eos``, and ``stream_options`` ``include_usage`` plus vLLM's
``continuous_usage_stats``, whose running ``completion_tokens`` count the tokens of each chunk
(text chunks do not map to tokens one to one). Works against `vconsole serve` and vLLM alike.

``portable=True`` sends only what every OpenAI-compatible server takes (``transformers serve``
refuses ``ignore_eos`` and token-id prompts): the prompt as text, one letter per token id
(`text_prompt`: each is one token for the built-in byte-level tokenizers), no ``ignore_eos``,
no vLLM extensions; a server without running usage counts one token per text chunk until its
final usage says how many there were.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from vconsole.engine.outputs import RequestOutput
from vconsole.engine.proc.async_client import drain_request
from vconsole.tools.sse_client import get_json, post_sse

DEFAULT_VOCAB = 1000      # prompts' token ids stay below this unless the server says more


def api_base(url: str) -> str:
    """The OpenAI base URL: ``http://host:8000`` and ``http://host:8000/v1`` both mean
    ``http://host:8000/v1`` (the server's root is what people paste; the SDK wants ``/v1``)."""
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    path = url.split("://", 1)[1].partition("/")[2]
    return url if path else url + "/v1"


def text_prompt(ids: Sequence[int]) -> str:
    """A text prompt standing for ``ids``: one lowercase letter per id."""
    return "".join(chr(97 + i % 26) for i in ids)


class HttpLoadClient:
    def __init__(self, api_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0, portable: bool = False) -> None:
        self.base = api_base(api_url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.model = model
        self.portable = portable
        self.engine_info: dict[str, Any] = {}
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ids = itertools.count()

    async def __aenter__(self) -> HttpLoadClient:
        listing = await asyncio.wait_for(get_json(self.base + "/models", self.headers),
                                         self.timeout_s)
        models = listing.get("data") or [] if isinstance(listing, dict) else []
        if not models:
            raise ValueError("the server lists no model")
        chosen = next((m for m in models if m.get("id") == self.model), None) if self.model \
            else models[0]
        if chosen is None:
            raise ValueError(f"the server has no model {self.model!r}: "
                             f"{', '.join(str(m.get('id')) for m in models)}")
        self.model = chosen["id"]
        self.engine_info = {"vocab_size": int(chosen.get("vocab_size") or DEFAULT_VOCAB),
                            "max_model_len": int(chosen.get("max_model_len") or 2048)}
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abort(list(self._tasks))

    async def submit(self, *, prompt_token_ids: Sequence[int], max_tokens: int,
                     ignore_eos: bool = True, priority: int = 0) -> str:
        rid = f"load-{next(self._ids)}"
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        self._tasks[rid] = asyncio.create_task(self._run(rid, list(prompt_token_ids),
                                                         max_tokens, ignore_eos, priority))
        return rid

    def _body(self, ids: list[int], max_tokens: int, ignore_eos: bool,
              priority: int) -> dict[str, Any]:
        if self.portable:
            return {"model": self.model, "prompt": text_prompt(ids), "max_tokens": max_tokens,
                    "stream": True, "temperature": 0.0,
                    "stream_options": {"include_usage": True}}
        return {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": ignore_eos, "priority": priority,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    async def _run(self, rid: str, ids: list[int], max_tokens: int, ignore_eos: bool,
                   priority: int) -> None:
        queue = self._queues[rid]
        seen = 0
        headers = self.headers if self.portable else {**self.headers, "x-request-id": rid}
        try:
            reason = None
            async with asyncio.timeout(self.timeout_s):
                async for chunk in post_sse(self.base + "/completions",
                                            self._body(ids, max_tokens, ignore_eos, priority),
                                            headers):
                    usage, choices = chunk.get("usage"), chunk.get("choices") or []
                    if usage:
                        total = int(usage.get("completion_tokens") or 0)
                    else:       # no running count: a chunk with text is a token
                        total = seen + bool(choices and choices[0].get("text"))
                    if choices and choices[0].get("finish_reason"):
                        reason = choices[0]["finish_reason"]
                    if total > seen:
                        queue.put_nowait(RequestOutput(rid, [0] * (total - seen),
                                                       num_output_tokens=total))
                        seen = total
            queue.put_nowait(RequestOutput(rid, [], True, reason or "stop",
                                           num_output_tokens=seen))
        except asyncio.CancelledError:
            queue.put_nowait(RequestOutput(rid, [], True, "abort", num_output_tokens=seen))
            raise
        except Exception as e:       # an HTTP or connection error: this request failed
            queue.put_nowait(RequestOutput(rid, [], True, "error", num_output_tokens=seen,
                                           error=f"{type(e).__name__}: {e}"))

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        try:
            async for out in drain_request(self._queues, request_id):
                yield out
        finally:
            self._tasks.pop(request_id, None)

    async def abort(self, request_ids: Iterable[str]) -> None:
        tasks = [t for rid in request_ids if (t := self._tasks.get(rid)) is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
