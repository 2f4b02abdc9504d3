"""The HTTP side of `vconsole serve`: a FastAPI app over `OpenAIServing`, run by uvicorn.

Routes, as vLLM's OpenAI server has them: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health`` (200 while the engine answers, 503 while it is
unreachable or restarting), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
``GET /metrics`` (the engine's Prometheus series, then this server's ``http_requests_total`` and
``http_request_duration_seconds`` by handler, method and status class), ``GET /load``
(``{"server_load": N}``, generation requests in flight, streams included).

``api_key``: every ``/v1/`` route wants ``Authorization: Bearer KEY`` (401 otherwise), as vLLM's
``--api-key``. An ``x-request-id`` header is echoed back and becomes the request's id in the
engine (the console's Requests screen shows the ids the application knows). A request body that does not validate is a 400 with OpenAI's error body, as vLLM
answers, not FastAPI's 422.

Invariant: a client that goes away mid-stream cancels its stream, which aborts its requests in
the engine (`EngineLink.samples`); nothing is left running for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vconsole.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vconsole.entrypoints.openai.serving import OpenAIServing

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 200      # the engine takes ids up to 256 characters; room for a suffix
RECONNECT_S = 1.0           # while the engine is unreachable: try its handshake this often
ENGINE_METRICS_TIMEOUT_S = 2.0
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


class HttpMetrics:
    """This server's own series, in a registry of its own (never the engine's)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("http_requests_total", "HTTP requests by handler, method and "
                                "status class.", ["handler", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("http_request_duration_seconds", "HTTP request latency (time "
                                 "to the response's start for streams).", ["handler", "method"],
                                 registry=self.registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.latency.labels(handler, method).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def build_app(serving: OpenAIServing, *, api_key: str | None = None,
              engine_metrics_url: str | None = None, version: str = "unknown") -> FastAPI:
    metrics = HttpMetrics()
    load = {"n": 0}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await serving.start()
        keeper = asyncio.create_task(_keep_connected(serving))
        try:
            yield
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await serving.engine.close()

    app = FastAPI(title="vconsole OpenAI-compatible server", version=version, lifespan=lifespan,
                  docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def measure(request: Request, call_next: Callable[[Request], Awaitable[Response]]
                      ) -> Response:
        path = request.url.path
        if api_key is not None and path.startswith("/v1/") and not _authorised(request,
                                                                               api_key):
            response: Response = JSONResponse({"error": "Unauthorized"}, status_code=401)
        else:
            start = time.perf_counter()
            response = await call_next(request)
            route = request.scope.get("route")
            handler = getattr(route, "path", None) or "unknown"
            metrics.observe(handler, request.method, response.status_code,
                            time.perf_counter() - start)
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ValueError)
    async def refused(_request: Request, e: ValueError) -> JSONResponse:
        """What the engine's client refuses before sending (its own validation)."""
        return JSONResponse(BadRequest(str(e)).body(), status_code=400)

    @app.exception_handler(TimeoutError)
    async def unreachable(_request: Request, e: TimeoutError) -> JSONResponse:
        return JSONResponse(BadRequest(f"the engine is unreachable: {e}", status=503,
                                       kind="ServiceUnavailableError").body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        bad = BadRequest(f"{where}: {first.get('msg', 'invalid request')}" if where
                         else str(first.get("msg", "invalid request")), param=where or None)
        return JSONResponse(bad.body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if serving.engine.healthy else 503)

    @app.get("/version")
    async def show_version() -> dict[str, str]:
        return {"version": version}

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        return {"server_load": load["n"]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return serving.detokenize(req)

    async def generation(request: Request, handler: Callable[..., Awaitable[
            dict[str, Any] | AsyncIterator[str]]], body: Any) -> Response:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None and not _good_request_id(given):
            raise BadRequest(f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID} printable "
                             "ASCII characters", param=REQUEST_ID_HEADER)
        echo = {REQUEST_ID_HEADER: given} if given else None
        load["n"] += 1
        try:
            result = await handler(body, given)
        except BaseException:
            load["n"] -= 1
            raise
        if isinstance(result, dict):
            load["n"] -= 1
            return JSONResponse(result, headers=echo)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in result:
                    yield event
            finally:
                load["n"] -= 1
        return StreamingResponse(events(), media_type="text/event-stream", headers=echo)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await generation(request, serving.completions, req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await generation(request, serving.chat, req)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        engine = await asyncio.to_thread(_scrape, engine_metrics_url)
        return PlainTextResponse(engine + metrics.text().decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _good_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


def _authorised(request: Request, api_key: str) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


def _scrape(url: str | None) -> str:
    """The engine's exposition text ("" without a metrics URL or when it does not answer)."""
    if not url:
        return ""
    try:
        with urllib.request.urlopen(url, timeout=ENGINE_METRICS_TIMEOUT_S) as r:
            return r.read().decode()
    except OSError:
        return ""


async def _keep_connected(serving: OpenAIServing) -> None:
    """Redo the engine handshake while the engine is unreachable (a restart), so ``/health``
    turns 200 again without waiting for a request."""
    while True:
        if not serving.engine.connected:
            with contextlib.suppress(TimeoutError, OSError):
                await serving.engine.reconnect()
        await asyncio.sleep(RECONNECT_S)
