"""A small HTTP/1.1 client for streaming OpenAI-style responses, on asyncio streams.

What `vllm bench serve` does with aiohttp, without a dependency and without an SDK's per-chunk
model objects: the load generator measures the server, not its own parsing. `get_json` for
``/v1/models``; `post_sse` yields each ``data:`` frame's JSON until ``[DONE]``. Both speak
plain HTTP or HTTPS (``ssl``), one connection per request (``Connection: close``), and read
chunked or length-delimited bodies. A status other than 200 raises `HttpError` with the
server's message. A body cut short (the connection closed inside a chunk or before the last
chunk or byte) raises `StreamCut`, and a stream whose body ends without ``[DONE]`` raises
`NoDone`: a measurement must never take a broken stream for a finished one.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any


class HttpError(OSError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class StreamCut(ConnectionError):
    """The connection closed before the body's end (inside or between chunks)."""


class NoDone(ValueError):
    """The body ended cleanly but the event stream had no ``data: [DONE]``."""


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:300]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return json.dumps(data)[:300]


class _Response:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.chunked = False
        self.length: int | None = None

    async def read_head(self) -> None:
        line = await self.reader.readline()
        if not line:
            raise StreamCut("the connection closed before the response's status line")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpError(0, f"not an HTTP response: {line[:80]!r}")
        self.status = int(parts[1])
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "content-length" and value.isdigit():
                self.length = int(value)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked."""
        try:
            if self.chunked:
                while True:
                    size_line = await self.reader.readline()
                    if not size_line.endswith(b"\n"):    # EOF where a chunk size belongs
                        raise StreamCut("the connection closed before the body's last chunk")
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    yield await self.reader.readexactly(size)
                    await self.reader.readline()          # the CRLF after each chunk
            elif self.length is not None:
                yield await self.reader.readexactly(self.length)
            else:
                while piece := await self.reader.read(65536):
                    yield piece
        except asyncio.IncompleteReadError as e:
            raise StreamCut(f"the connection closed {len(e.partial)} bytes into a piece of "
                            f"{e.expected} bytes") from None

    async def body(self) -> bytes:
        return b"".join([p async for p in self.pieces()])

    def close(self) -> None:
        self.writer.close()


async def _request(url: str, method: str, body: bytes | None,
                   headers: dict[str, str]) -> _Response:
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=ssl.create_default_context() if tls else None)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b""))
    resp = _Response(reader, writer)
    try:
        await resp.read_head()
    except BaseException:
        resp.close()
        raise
    return resp


async def get_json(url: str, headers: dict[str, str]) -> Any:
    resp = await _request(url, "GET", None, headers)
    try:
        data = await resp.body()
    finally:
        resp.close()
    if resp.status != 200:
        raise HttpError(resp.status, _error_message(data))
    return json.loads(data)


async def post_sse(url: str, payload: dict[str, Any],
                   headers: dict[str, str]) -> AsyncGenerator[dict[str, Any], None]:
    """Each ``data:`` event's JSON, until ``[DONE]``; `NoDone` if the body ends without it
    (the caller decides whether a server that never sends it is acceptable)."""
    resp = await _request(url, "POST", json.dumps(payload).encode(), headers)
    try:
        if resp.status != 200:
            raise HttpError(resp.status, _error_message(await resp.body()))
        pending = b""
        async for piece in resp.pieces():
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        raise NoDone("the event stream ended without data: [DONE]")
    finally:
        resp.close()
