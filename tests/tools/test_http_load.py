"""`vconsole load --api-url` counts every way a streamed request can fail, by kind.

A small real HTTP server on a loopback socket (asyncio streams, in the test) answers each
``/v1/completions`` as a script says: a whole stream, an error event, a stream without
``[DONE]``, a status 500 or 503, fewer tokens than ``max_tokens`` under ``ignore_eos``, a
connection closed mid-stream. The load client (`HttpLoadClient` through `run_load`, and the
`vconsole load` command as a process) must report each as a failure of its kind, never as
completed, and exit 1. The same load against a real `vconsole serve` whose engine is killed
mid-stream is at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support.live_engine import ipc_endpoints, wait_for_steps
from support.serve_process import ENGINE, serve, status, wait_until
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.tools.http_load import HttpLoadClient
from vconsole.tools.load_summary import format_summary
from vconsole.tools.loadgen import LoadSpec, run_load

MODEL = {"id": "fake", "object": "model", "vocab_size": 300, "max_model_len": 4096}


class ScriptedServer:
    """An OpenAI-shaped streaming server whose n-th completion follows ``script[n]`` (the last
    entry repeats): ``ok``, ``error_event``, ``no_done``, ``cut``, ``short``, ``status_500``,
    ``status_503``, ``close`` (the connection closed before any response), ``hang`` (half the
    tokens, then nothing)."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.served = 0
        self.hanging = 0                            # ``hang`` streams that sent their tokens
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.handlers:                  # a hanging stream's handler, say
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)
        try:
            method, path, headers = await _read_head(reader)
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                await _send_json(writer, 200, {"object": "list", "data": [MODEL]})
            elif method == "POST" and path == "/v1/completions":
                how = self.script[min(self.served, len(self.script) - 1)]
                self.served += 1
                await self._complete(writer, how, json.loads(body))
            else:
                await _send_json(writer, 404, {"error": {"message": "no route", "code": 404}})
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, how: str,
                        req: dict[str, Any]) -> None:
        if how == "close":
            return
        if how.startswith("status_"):
            code = int(how[7:])
            await _send_json(writer, code, {"error": {"message": f"scripted {code}",
                                                      "type": "ServerError", "code": code}})
            return
        n = int(req["max_tokens"])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        tokens = n // 2 if how in ("short", "error_event", "cut", "hang") else n
        for i in range(1, tokens + 1):
            last = i == tokens and how in ("ok", "no_done", "short")
            reason = ("stop" if how == "short" else "length") if last else None
            await _event(writer, {"choices": [{"index": 0, "text": "a",
                                               "finish_reason": reason}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": i}})
        if how == "cut":
            await writer.drain()
            return                                  # no last chunk: the connection just ends
        if how == "hang":
            await writer.drain()
            self.hanging += 1
            await asyncio.sleep(3600)               # until the client goes away
        if how == "error_event":
            await _event(writer, {"error": {"message": "engine unreachable: scripted",
                                            "type": "ServiceUnavailableError", "code": 503}})
        if how != "no_done":
            await _chunk(writer, b"data: [DONE]\n\n")
        await _chunk(writer, b"")                    # the body's proper end


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    method, path, _ = (await reader.readline()).decode().split(" ", 2)
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _send_json(writer: asyncio.StreamWriter, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()


async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def _event(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    await _chunk(writer, b"data: " + json.dumps(body).encode() + b"\n\n")


async def _load(script: list[str], num: int, **client: Any) -> dict[str, Any]:
    async with ScriptedServer(script) as server, HttpLoadClient(server.url, **client) as c:
        run = await run_load(c, LoadSpec(num=num, concurrency=1, prompt_len=(3, 3),
                                         output_len=(8, 8)))
    return run.summary()


@pytest.mark.parametrize(("how", "kind"), [
    ("error_event", "error_event"), ("no_done", "no_done"), ("short", "short_output"),
    ("status_500", "http_500"), ("status_503", "http_503"), ("cut", "connection"),
    ("close", "connection"),
])
async def test_each_way_a_stream_fails_is_counted_as_an_error_of_its_kind(how: str,
                                                                           kind: str) -> None:
    s = await _load(["ok", how, "ok"], 3)
    assert s["requests"] == 3 and s["completed"] == 2 and s["failed"] == 1, s
    assert s["errors"] == {kind: 1}, s
    example = s["error_examples"][kind]
    assert example and not example.startswith(f"{kind}:"), example
    text = format_summary(s)
    assert "requests     3 (2 completed, 1 failed)" in text and f"errors       {kind} 1" in text
    assert f"\n  {kind}: {example[:40]}" in text


async def test_a_whole_stream_completes_with_its_tokens_counted() -> None:
    s = await _load(["ok"], 4)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (4, 4, 0, {})
    assert s["output_tokens"] == 4 * 8 and s["finish_reasons"] == {"length": 4}
    assert "errors       none" in format_summary(s)


async def test_portable_mode_takes_a_stream_without_done_that_finished() -> None:
    # transformers serve never sends [DONE] and has no ignore_eos: a stream that said its
    # finish reason and ended is whole there; an error event still fails.
    s = await _load(["no_done", "short", "error_event"], 3, portable=True)
    assert s["completed"] == 2 and s["errors"] == {"error_event": 1}, s


async def test_bench_serve_reports_no_figures_from_a_run_whose_requests_failed() -> None:
    from vconsole.tools.bench.serve import RequestsFailed, _run

    spec = LoadSpec(num=3, concurrency=1, prompt_len=(3, 3), output_len=(8, 8))
    async with ScriptedServer(["ok", "error_event", "ok"]) as server:
        with pytest.raises(RequestsFailed, match=r"2 of 3 .* \(errors: error_event 1\)"):
            await _run(HttpLoadClient(server.url), spec)


class CliLoad:
    """`vconsole load --api-url` as a process against a scripted server in this loop."""

    @staticmethod
    async def run(script: list[str], num: int, *extra: str) -> tuple[int, str, str]:
        async with ScriptedServer(script) as server:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "vconsole", "load", "--api-url", server.url, "--num",
                str(num), "--concurrency", "1", "--prompt-len", "3", "--output-len", "8",
                *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()


async def test_the_command_exits_1_and_names_every_kind_of_failure() -> None:
    script = ["ok", "error_event", "no_done", "status_503", "short", "cut", "ok"]
    code, out, err = await CliLoad.run(script, 7, "--json")
    s = json.loads(out)
    assert code == 1, err
    assert s["requests"] == 7 and s["completed"] == 2 and s["failed"] == 5
    assert s["errors"] == {"error_event": 1, "no_done": 1, "http_503": 1, "short_output": 1,
                           "connection": 1}
    assert "5 of 7 requests failed" in err


async def test_the_command_exits_0_when_every_request_completed() -> None:
    code, out, err = await CliLoad.run(["ok"], 5)
    assert code == 0, err
    assert "requests     5 (5 completed) in" in out and "errors       none" in out


async def test_ctrl_c_aborts_what_is_in_flight_without_calling_it_a_failure() -> None:
    async with ScriptedServer(["ok", "hang"]) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "vconsole", "load", "--api-url", server.url, "--num", "5",
            "--concurrency", "1", "--prompt-len", "3", "--output-len", "8",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while server.hanging < 1:                   # the second request is hanging
            assert time.monotonic() < deadline, "the load never sent its second request"
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert "requests     2 of 5 (1 completed, 1 aborted on stop)" in out.decode()
    assert "errors       none" in out.decode()
    assert "stopped by Ctrl-C after 2 of 5 requests (1 in flight aborted)" in err.decode()


# --- a real server whose engine is killed mid-stream -------------------------------------------

@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.long   # make test-long (20-30 s): the scripted server above covers every kind
def test_a_load_over_http_whose_engine_is_killed_reports_the_cut_requests_and_exits_1(
        tmp_path: Path) -> None:
    # Long requests (ignore_eos, 1,500-2,000 tokens) so that they are still streaming when the
    # engine's process is killed: all three are in flight then, and all three must be counted
    # as failed (the supervisor brings the engine back; nothing is left to send it).
    with EngineProcess([*ENGINE, "--num-kv-blocks", "1200", "--restart-backoff", "0.5"],
                       endpoints=ipc_endpoints(tmp_path)) as engine:
        child, port, log = serve(tmp_path, "--engine-ready-file", str(engine.ready_path))
        try:
            wait_until(lambda: status(port) == 200, "the server never became healthy", log)
            out_path = tmp_path / "load.json"
            with open(out_path, "wb") as out:
                load = subprocess.Popen(
                    [sys.executable, "-m", "vconsole", "load", "--api-url",
                     f"http://127.0.0.1:{port}", "--num", "3", "--concurrency", "3",
                     "--prompt-len", "4:8", "--output-len", "1500:2000", "--json"],
                    stdout=out, stderr=subprocess.PIPE)
            wait_until(lambda: _server_load(port) >= 1, "no request reached the server", log)
            wait_for_steps(engine.endpoints["telemetry"], 20)   # tokens are streaming
            os.kill(engine.ready["child_pid"], signal.SIGKILL)
            _, err = load.communicate(timeout=600)
            summary = json.loads(out_path.read_text())
            said = f"{summary}\n{err.decode()[-2000:]}"
            assert load.returncode == 1, said
            assert summary["failed"] >= 1 and summary["errors"].get("error_event", 0) >= 1, said
            assert "engine unreachable" in summary["error_examples"]["error_event"], said
            assert summary["completed"] + summary["failed"] == summary["requests"] == 3, said
            assert summary["output_tokens"] < 3 * 2000, said
            assert "requests failed (" in err.decode(), said
        finally:
            child.stop(30, signal.SIGINT)


def _server_load(port: int) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/load", timeout=10) as r:
            return int(json.loads(r.read())["server_load"])
    except OSError:
        return 0

