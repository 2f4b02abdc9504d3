"""The HTTP side of `vconsole serve`: a FastAPI app over one serving class per endpoint (all
sharing one `OpenAIServing`: the model, its engine), run by uvicorn.

Routes, as vLLM's OpenAI server has them: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health`` (200 while the engine answers, 503 while it is
unreachable or restarting), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
``GET /metrics`` (the engine's Prometheus series, then this server's ``http_requests_total`` and
``http_request_duration_seconds`` by handler, method and status class), ``GET /load``
(``{"server_load": N}``, generation requests in flight, streams included).

``api_key``: every ``/v1/`` route wants ``Authorization: Bearer KEY`` (401 otherwise), as vLLM's
``--api-key``. An ``x-request-id`` header is echoed back and becomes the request's id in the
engine (the console's Requests screen shows the ids the application knows).

Every error of every route has OpenAI's body ``{"error": {"message", "type", "param", "code"}}``
(the SDK raises with its message): a body that does not validate is a 400 whose ``param`` is the
field's path (``messages.0.role``), not FastAPI's 422; a body that is not JSON a 400 saying so
(``param`` null); an unknown route a 404 naming the routes there are; a wrong method a 405; a
missing API key a 401; ``/health`` a 503 while the engine is down, and so every generation
request that comes then (before a stream's 200: `EngineLink.check_reachable`); anything
unexpected a 500. A stream whose 200 is sent ends with its error as an event, then ``[DONE]``,
whatever failed (`_stream_events`): never an empty or cut body.
There is no ``/docs`` nor ``/openapi.json``: the API is OpenAI's (docs/serve.md lists what this
server takes), and FastAPI's docs page would fetch its scripts from a CDN.

Invariant: a client that goes away mid-stream cancels its stream, which aborts its requests in
the engine (`EngineLink.samples`); nothing is left running for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException

from vconsole.entrypoints.openai import tracing
from vconsole.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    refusal,
)
from vconsole.entrypoints.openai.request_metrics import RequestSizeMetrics
from vconsole.entrypoints.openai.serving_base import DONE, OpenAIServing, sse
from vconsole.entrypoints.openai.serving_chat import OpenAIServingChat
from vconsole.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vconsole.entrypoints.openai.serving_models import OpenAIServingModels
from vconsole.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 200      # the engine takes ids up to 256 characters; room for a suffix
RECONNECT_S = 1.0           # while the engine is unreachable: try its handshake this often
ENGINE_METRICS_TIMEOUT_S = 2.0
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
# pydantic's tags for the member of a union a value was tried against: not part of a field path
UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})
log = logging.getLogger(__name__)
HTTP_ERROR_KINDS = {401: "AuthenticationError", 404: "NotFoundError",
                    405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                    415: "UnsupportedMediaTypeError", 503: "ServiceUnavailableError"}


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
    if serving.tracer is not None:
        metrics.registry.register(serving.tracer.collector())
    serving.request_metrics = RequestSizeMetrics(metrics.registry)
    load = {"n": 0}
    served_models = OpenAIServingModels(serving)
    tokenization = OpenAIServingTokenization(serving)
    completion = OpenAIServingCompletion(serving)
    chat_completion = OpenAIServingChat(serving)

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
            if serving.tracer is not None:      # the spans still queued, within a timeout
                await asyncio.to_thread(serving.tracer.shutdown)

    app = FastAPI(title="vconsole OpenAI-compatible server", version=version, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def measure(request: Request, call_next: Callable[[Request], Awaitable[Response]]
                      ) -> Response:
        path = request.url.path
        if api_key is not None and path.startswith("/v1/") and not _authorised(request,
                                                                               api_key):
            response: Response = _error(401, "a valid API key is needed: send the header "
                                        "Authorization: Bearer KEY", {"WWW-Authenticate":
                                                                      "Bearer"})
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
        bad = validation_error(list(e.errors()))
        return JSONResponse(bad.body(), status_code=bad.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message = f"{where}: no such route; this server serves {_routes(app)}"
        elif e.status_code == 405:
            allow = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow")
            message = f"{where}: method not allowed; this route takes {allow or 'another'}"
        else:
            message = f"{where}: {e.detail}"
        return _error(e.status_code, message, e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        """A bug, not the client's fault: OpenAI's shape still (uvicorn logs the trace)."""
        return _error(500, f"{request.method} {request.url.path}: internal error: "
                           f"{type(e).__name__}: {e}")

    @app.get("/health")
    async def health() -> Response:
        if serving.engine.healthy:
            return Response(status_code=200)
        return _error(503, "the engine is unreachable (stopped, or restarting)")

    @app.get("/version")
    async def show_version() -> dict[str, str]:
        return {"version": version}

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        return {"server_load": load["n"]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return served_models.models()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return tokenization.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return tokenization.detokenize(req)

    async def generation(request: Request, handler: Callable[..., Awaitable[
            dict[str, Any] | AsyncIterator[str]]], body: Any) -> Response:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None and not _good_request_id(given):
            raise BadRequest(f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID} printable "
                             "ASCII characters", param=REQUEST_ID_HEADER)
        echo = {REQUEST_ID_HEADER: given} if given else None
        tracing.incoming.set(request.headers)   # traceparent: the spans join the caller's trace
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
                async for event in _stream_events(result, request.url.path):
                    yield event
            finally:
                load["n"] -= 1
        return StreamingResponse(events(), media_type="text/event-stream", headers=echo)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await generation(request, completion.create, req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await generation(request, chat_completion.create, req)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        engine = await asyncio.to_thread(_scrape, engine_metrics_url)
        return PlainTextResponse(engine + metrics.text().decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _stream_events(events: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    """A stream's events; what escapes it once its 200 is sent becomes its last event (503 for
    an engine that did not answer, 500 with one traceback in the log for anything else) and
    ``[DONE]``: the status can no longer say it, and Starlette would only log it twice."""
    try:
        async for event in events:
            yield event
    except TimeoutError as e:
        log.warning("POST %s: stream ended by a 503: the engine is unreachable: %s", path, e)
        yield sse(BadRequest(f"the engine is unreachable: {e}", status=503,
                             kind="ServiceUnavailableError").body())
        yield DONE
    except Exception as e:
        log.exception("POST %s: stream ended by an internal error", path)
        yield sse(BadRequest(f"POST {path}: internal error: {type(e).__name__}: {e}",
                             status=500, kind="InternalServerError").body())
        yield DONE


def _error(status: int, message: str, headers: Any = None) -> JSONResponse:
    kind = HTTP_ERROR_KINDS.get(status, "InternalServerError" if status >= 500
                                else "BadRequestError")
    return JSONResponse(BadRequest(message, status=status, kind=kind).body(),
                        status_code=status, headers=headers)


def _routes(app: FastAPI) -> str:
    """``GET /v1/models, POST /v1/completions, ...``: what a 404 lists."""
    return ", ".join(f"{'/'.join(sorted(r.methods or ()))} {r.path}" for r in app.routes
                     if isinstance(r, APIRoute))


def validation_error(errors: list[Any]) -> BadRequest:
    """pydantic's first complaint about a body as OpenAI's 400: ``param`` is the field's
    path (``messages.0.role``, pydantic's union tags left out), null for the body as a
    whole; a body that is not JSON says so, not ``25: JSON decode error``."""
    first = errors[0] if errors else {}
    kind, msg = first.get("type"), str(first.get("msg", "invalid request"))
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if kind == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or msg
        at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return BadRequest(f"the request body is not valid JSON: {why}{at}")
    path = ".".join(str(x) for x in loc if isinstance(x, int) or not (
        "[" in x or x in UNION_TAGS))
    if not path:
        if kind == "missing":
            return BadRequest("the request body is empty: send a JSON object")
        return BadRequest("the request body must be a JSON object, sent with Content-Type: "
                          f"application/json ({msg})")
    if kind == "extra_forbidden":
        return BadRequest(refusal(path), param=path)
    return BadRequest(f"{path}: {msg}", param=path)


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
