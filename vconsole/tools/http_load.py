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

A request counts as completed only when its stream ended whole: ``[DONE]`` after a finish
reason, no ``data: {"error": ...}`` event, and, with ``ignore_eos``, every token asked for.
Anything else is a failure of its kind (`ERROR_KINDS`), which `vconsole load` counts, prints
and exits 1 on. Portable mode accepts a stream without ``[DONE]`` once it said its finish
reason (``transformers serve`` never sends it) and cannot ask for ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from vconsole.engine.client.async_client import drain_request
from vconsole.tools.sse_client import HttpError, NoDone, StreamCut, get_json, post_sse
from vconsole.wire.outputs import RequestOutput

DEFAULT_VOCAB = 1000      # prompts' token ids stay below this unless the server says more

# How a request over HTTP can fail, each counted apart in the load's summary (a final
# RequestOutput with finish_reason "error" whose ``error`` starts with "KIND: "; `kind_of`):
ERROR_KINDS = {
    "error_event": "the stream carried a data: {\"error\": ...} event",
    "no_done": "the stream ended without data: [DONE]",
    "short_output": "fewer tokens than max_tokens though ignore_eos was set",
    "http_NNN": "the server answered with status NNN",
    "connection": "no connection, or it closed before the response ended",
    "bad_event": "an event that is not JSON",
    "timeout": "no end within the client's timeout",
}


def classify_exception(e: BaseException, timeout_s: float) -> str:
    """``"KIND: detail"`` for an exception that ended a request."""
    if isinstance(e, HttpError):
        return f"http_{e.status}: {e}"
    if isinstance(e, TimeoutError):
        return f"timeout: no end within {timeout_s:g} s"
    if isinstance(e, StreamCut | OSError | EOFError):
        return f"connection: {type(e).__name__}: {e}"
    if isinstance(e, ValueError):       # json.JSONDecodeError
        return f"bad_event: {e}"
    return f"error: {type(e).__name__}: {e}"


def _error_text(err: Any) -> str:
    """An error event's body as one line: ``code type: message``."""
    if isinstance(err, dict):
        head = " ".join(str(err[k]) for k in ("code", "type") if err.get(k) is not None)
        msg = str(err.get("message") or "")
        return f"{head}: {msg}" if head else msg or json.dumps(err)
    return str(err)


class _Stream:
    """What one streamed response said so far, and the verdict on it at its end."""

    def __init__(self, max_tokens: int, *, expect_full: bool, need_done: bool) -> None:
        self.max_tokens = max_tokens
        self.expect_full = expect_full       # ignore_eos was sent: max_tokens must come
        self.need_done = need_done           # a server that never sends [DONE] is portable's
        self.seen = 0
        self.reason: str | None = None
        self.error: str | None = None
        self.done_missing = False

    def take(self, event: dict[str, Any]) -> int:
        """Count one event; the number of new tokens it brought."""
        if event.get("error"):
            self.error = _error_text(event["error"])
            return 0
        usage, choices = event.get("usage"), event.get("choices") or []
        if usage:
            total = int(usage.get("completion_tokens") or 0)
        else:       # no running count: a chunk with text is a token
            total = self.seen + bool(choices and choices[0].get("text"))
        if choices and choices[0].get("finish_reason"):
            self.reason = choices[0]["finish_reason"]
        new = max(0, total - self.seen)
        self.seen = max(self.seen, total)
        return new

    def verdict(self) -> tuple[str, str | None]:
        """(finish_reason, error) of the finished stream: an error event, a missing [DONE] or
        finish reason, or a short output under ignore_eos make it an ``error``."""
        if self.error is not None:
            return "error", f"error_event: {self.error}"
        if self.done_missing and (self.need_done or self.reason is None):
            return "error", (f"no_done: the stream ended without [DONE] after {self.seen} "
                             "tokens")
        if self.reason not in (None, "length", "stop"):
            return self.reason, f"the server ended it: {self.reason}"
        if self.expect_full and self.seen < self.max_tokens:
            return "error", (f"short_output: {self.seen} of {self.max_tokens} tokens with "
                             f"ignore_eos (finish_reason {self.reason})")
        return self.reason or "stop", None


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
    # A usage block says no prompt tokens came from the prefix cache (`vconsole serve` sends
    # none; vLLM's ``prompt_tokens_details`` is opt-in): the load's ``cached_tokens`` is None.
    reports_cached_tokens = False

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
                            "max_model_len": int(chosen.get("max_model_len") or 2048),
                            "model": self.model, "model_path": chosen.get("root")}
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
        """Stream one request into its queue; its final output says how it ended: the
        server's finish reason, or ``error`` with `ERROR_KINDS`' kind first in ``error``."""
        queue = self._queues[rid]
        stream = _Stream(max_tokens, expect_full=ignore_eos and not self.portable,
                         need_done=not self.portable)
        headers = self.headers if self.portable else {**self.headers, "x-request-id": rid}
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._read(rid, ids, max_tokens, ignore_eos, priority, headers, stream,
                                 queue)
            reason, error = stream.verdict()
        except asyncio.CancelledError:
            queue.put_nowait(RequestOutput(rid, [], True, "abort",
                                           num_output_tokens=stream.seen))
            raise
        except Exception as e:       # the request failed: say how, by kind
            reason, error = "error", classify_exception(e, self.timeout_s)
        queue.put_nowait(RequestOutput(rid, [], True, reason, num_output_tokens=stream.seen,
                                       error=error))

    async def _read(self, rid: str, ids: list[int], max_tokens: int, ignore_eos: bool,
                    priority: int, headers: dict[str, str], stream: _Stream,
                    queue: asyncio.Queue[RequestOutput]) -> None:
        events = post_sse(self.base + "/completions",
                          self._body(ids, max_tokens, ignore_eos, priority), headers)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    new = stream.take(event)
                    if new:
                        queue.put_nowait(RequestOutput(rid, [0] * new,
                                                       num_output_tokens=stream.seen))
                    if stream.error is not None:
                        return            # an error event ends the request: read no further
        except NoDone:
            stream.done_missing = True

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


def kind_of(error: str | None) -> str | None:
    """The kind an ``error`` written by this client starts with (`ERROR_KINDS`), else None."""
    head, sep, _ = (error or "").partition(": ")
    if not sep:
        return None
    if head in ERROR_KINDS or (head.startswith("http_") and head[5:].isdigit()):
        return head
    return None
