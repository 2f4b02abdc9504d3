"""`vconsole serve`: the engine (supervised) and an OpenAI-compatible HTTP server in front of it.

The engine runs as its own process tree (`EngineProcess`: ``vconsole engine`` with this
command's engine flags, read once into an `EngineLaunch`), with a private Prometheus port the
server's ``/metrics`` relays. The HTTP server (`vconsole.entrypoints.openai`) runs here, under
uvicorn, and talks to the engine over the engine's own protocol, as any client does; with
``--engine-ready-file`` it fronts an engine that is already running (a lone engine or a
data-parallel group's front end) and starts none.

The HTTP port is bound first, before any engine starts or any model loads: a port in use is
one line (``vconsole serve: port 8000 on 127.0.0.1 is in use ...``) and exit code
`exit_codes.CANNOT_START`, as every other start-up error of this command, within a second; the
bound socket is handed to uvicorn, so nothing can take the port in between.

Invariant: when this command returns, the engine it started has been stopped (SIGTERM, a drain,
then SIGKILL), whether uvicorn stopped on Ctrl-C or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace

from vconsole import __version__
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security.bind_policy import RemoteBindRefused, check_http_host
from vconsole.shared.config import ConfigError
from vconsole.wire import exit_codes
from vconsole.wire.ready_file import ReadyFileError, read_ready_file

API_KEY_ENV = "VCONSOLE_API_KEY"
log = logging.getLogger("vconsole.serve")


def _say(message: object) -> None:
    print(f"vconsole serve: {message}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        check_http_host(args.host, api_key is not None, args.allow_no_api_key)
    except RemoteBindRefused as e:
        _say(e)
        return exit_codes.CANNOT_START
    problem = _tool_flags_problem(args)
    if problem:
        _say(problem)
        return exit_codes.CANNOT_START
    if args.otlp_traces_endpoint:
        from vconsole.entrypoints.openai.tracing import check_endpoint
        try:
            check_endpoint(args.otlp_traces_endpoint)
        except (ValueError, RuntimeError) as e:
            _say(e)
            return exit_codes.CANNOT_START
    chat_template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as fh:
                chat_template = fh.read()
        except OSError as e:
            _say(f"--chat-template: {e}")
            return exit_codes.CANNOT_START
    try:
        sock = bind_http(args.host, args.port)
    except OSError as e:
        _say(e)
        return exit_codes.CANNOT_START
    with sock:
        return _run(args, sock, api_key, chat_template)


def _tool_flags_problem(args: argparse.Namespace) -> str | None:
    """Why ``--enable-auto-tool-choice`` / ``--tool-call-parser`` cannot serve (None: they
    can): an unknown parser, or auto tool choice without one (vLLM's rule)."""
    from vconsole.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

    parser = args.tool_call_parser
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        return (f"--tool-call-parser {parser!r} is not one this server has: "
                f"{', '.join(TOOL_CALL_PARSERS)}")
    if args.enable_auto_tool_choice and parser is None:
        return ("--enable-auto-tool-choice needs --tool-call-parser (hermes): it reads the "
                "calls out of the model's text")
    return None


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP server's listening socket, bound now (before the engine starts), as uvicorn
    binds it (``SO_REUSEADDR``); `OSError` with one readable sentence when it cannot be."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: unknown host ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is in use ({e.strerror}): stop what listens "
                          "there or choose another --port") from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _run(args: argparse.Namespace, sock: socket.socket, api_key: str | None,
         chat_template: str | None) -> int:
    """Start (or find) the engine and serve HTTP on ``sock`` until stopped."""
    engine: EngineProcess | None = None
    if args.engine_ready_file:
        try:
            record = read_ready_file(args.engine_ready_file)
        except ReadyFileError as e:
            _say(e)
            return exit_codes.CANNOT_START
        if record is None:
            _say(f"no engine ready file at {args.engine_ready_file}")
            return exit_codes.CANNOT_START
        endpoints, metrics_url = record["endpoints"], record.get("metrics")
    else:
        # transformers' import (the server's tokenizer) takes seconds: done while the engine
        # loads its model, not after.
        threading.Thread(target=_import_tokenizers, name="import-transformers",
                         daemon=True).start()
        try:
            engine = _start_engine(args)
        except (ConfigError, ValueError, OSError) as e:
            _say(e)
            return exit_codes.CANNOT_START
        except RuntimeError as e:
            _say(e)
            return exit_codes.FAILED
        endpoints, metrics_url = engine.endpoints, engine.ready.get("metrics")
    try:
        return _serve_http(args, sock, endpoints, metrics_url, api_key, chat_template)
    finally:
        if engine is not None:
            code = engine.stop()
            log.info("engine stopped (exit code %s)", code)


def _import_tokenizers() -> None:
    with contextlib.suppress(Exception):      # the server imports it again, and says why
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401


def _start_engine(args: argparse.Namespace) -> EngineProcess:
    from vconsole.commands.engine import launch_from_args
    from vconsole.engine.launch.engine_process import engine_env_beside_clients

    launch = launch_from_args(args)
    # The engine's /metrics on a private port unless the user asked for one: the server's own
    # /metrics relays it. The ready file is the launcher's (EngineProcess writes its own).
    launch = replace(launch, ready_file=None, metrics=launch.metrics or ("127.0.0.1", 0))
    log.info("starting the engine (%s) ...", launch.config.model)
    # The HTTP server shares the machine with the engine: on a CPU, leave it a core.
    # EngineProcess names the endpoints on the command line itself.
    return EngineProcess(replace(launch, endpoints={}).argv(), endpoints=dict(launch.endpoints),
                         inherit_output=True,
                         env=engine_env_beside_clients(launch.config.data_parallel_size)
                         ).start(timeout_s=600)


def _serve_http(args: argparse.Namespace, sock: socket.socket, endpoints: dict[str, str],
                metrics_url: str | None, api_key: str | None, chat_template: str | None
                ) -> int:
    import uvicorn

    from vconsole.entrypoints.openai.api_server import build_app
    _Server = _server_class()
    from vconsole.entrypoints.openai.engine_link import EngineLink
    from vconsole.entrypoints.openai.serving_base import OpenAIServing

    serving = OpenAIServing(EngineLink(endpoints["input"], endpoints["output"]),
                            model_name=args.served_model_name or args.model,
                            chat_template=chat_template,
                            tool_call_parser=(args.tool_call_parser
                                              if args.enable_auto_tool_choice else None))
    if args.otlp_traces_endpoint:
        from vconsole.entrypoints.openai.tracing import RequestTracer
        serving.tracer = RequestTracer(args.otlp_traces_endpoint)
    serving.per_request_metrics = args.enable_per_request_metrics
    app = build_app(serving, api_key=api_key, engine_metrics_url=metrics_url,
                    version=__version__)
    print(f"vconsole serve: http://{args.host}:{args.port}/v1 in front of the engine at "
          f"input={endpoints['input']}", file=sys.stderr, flush=True)
    # log_config None: uvicorn's loggers (access lines too) go to this command's stderr
    # handler, so stdout stays free for whoever pipes it.
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                    log_config=None, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return exit_codes.OK if server.started else exit_codes.CANNOT_START


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end `run` and this command goes on to
        stop its engine (uvicorn would raise the signal again once it stopped, killing this
        process before its engine is stopped)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server

