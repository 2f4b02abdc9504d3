"""`vconsole serve` as a user runs it: its own engine, or in front of a running one; /health
follows the engine through a crash and its restart; Ctrl-C leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from pathlib import Path

import openai
import psutil
import pytest

from support.live_engine import ipc_endpoints
from support.serve_process import ENGINE, free_port, serve, status, wait_until
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security.bind_policy import RemoteBindRefused, check_http_host


@pytest.mark.proc
@pytest.mark.slow
def test_serve_starts_its_engine_answers_the_sdk_and_ctrl_c_stops_both(tmp_path: Path) -> None:
    eps = ipc_endpoints(tmp_path)
    child, port, log = serve(tmp_path, *ENGINE, *[f"--{n}={ep}" for n, ep in eps.items()],
                             "--served-model-name", "my-model")
    try:
        wait_until(lambda: status(port) == 200, "the server never became healthy", log)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["my-model"]
        r = c.chat.completions.create(model="my-model", max_tokens=4, temperature=0,
                                      messages=[{"role": "user", "content": "hello"}])
        assert r.choices[0].finish_reason in ("length", "stop")
        child.send_signal(signal.SIGINT)
        assert child.wait(60) == 0, log.read_text()[-3000:]
    finally:
        child.kill()
    text = log.read_text()
    assert "engine stopped (SIGTERM)" in text and "engine stopped (exit code 0)" in text
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(eps["input"] in arg for arg in p.info["cmdline"] or ())]
    assert left == []                     # no engine process (supervisor or child) is left


@pytest.mark.long   # make test-long: a dead engine's 503 and the restart are test_a_dead_engine_fails_its_streams...
@pytest.mark.proc
def test_a_frozen_engine_turns_health_503_without_failing_the_stream_it_resumes(
        tmp_path: Path) -> None:
    # /health follows the console's ENGINE DOWN rule (three silent heartbeats), not the
    # client's ten after which requests in flight fail: an engine stopped for five seconds
    # is reported down, and the stream it was writing still finishes whole when it resumes.
    with EngineProcess(["--num-kv-blocks", "300", "--block-size", "8"],
                       endpoints=ipc_endpoints(tmp_path)) as engine:
        child, port, log = serve(tmp_path, "--engine-ready-file", str(engine.ready_path))
        try:
            wait_until(lambda: status(port) == 200, "the server never became healthy", log)
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                              max_retries=0, timeout=60)
            stream = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2000,
                                          extra_body={"ignore_eos": True}, stream=True,
                                          stream_options={"include_usage": True})
            chunks = iter(stream)
            next(chunks)                                  # the engine is writing it
            pid = engine.ready["child_pid"]
            os.kill(pid, signal.SIGSTOP)
            try:
                frozen = time.monotonic()
                seen = []
                while time.monotonic() - frozen < 5.0:
                    seen.append(status(port))
                    time.sleep(0.1)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert seen[0] == 200 and 503 in seen, seen
            rest = list(chunks)
            assert rest[-1].usage.completion_tokens == 2000     # nothing lost, nothing failed
            wait_until(lambda: status(port) == 200, "/health never came back", log, 30)
        finally:
            child.stop(30, signal.SIGINT)



def stream_and_kill(port: int, engine: EngineProcess) -> tuple[list[str], float]:
    """Start a long stream, kill -9 the engine's child once it is writing, read the stream to
    its end: the ``data:`` events and the seconds from the kill to the stream's end."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True,
         "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")       # the engine is writing it
    os.kill(engine.ready["child_pid"], signal.SIGKILL)
    killed = time.monotonic()
    events = [line[6:].strip() for line in resp.read().decode().splitlines()
              if line.startswith("data: ")]
    return events, time.monotonic() - killed

def refused_while_down(c: openai.OpenAI) -> list[tuple[str, int, float]]:
    """Send a plain and a streamed request of each API while the engine is down: (what, HTTP
    status, seconds to the answer) for each; a 200 is read to its end first."""
    answers = []
    for what, send in [
        ("completion", lambda: c.completions.create(model="tiny", prompt="hi", max_tokens=3)),
        ("completion stream", lambda: list(c.completions.create(
            model="tiny", prompt="hi", max_tokens=3, stream=True))),
        ("chat", lambda: c.chat.completions.create(model="tiny", max_tokens=3, messages=[
            {"role": "user", "content": "hi"}])),
        ("chat stream", lambda: list(c.chat.completions.create(
            model="tiny", max_tokens=3, stream=True, messages=[
                {"role": "user", "content": "hi"}])))]:
        start = time.monotonic()
        try:
            send()
            code = 200
        except openai.APIStatusError as e:
            code = e.status_code
            assert "503 - engine unreachable: " in e.message, e.message
        answers.append((what, code, time.monotonic() - start))
    return answers


@pytest.mark.proc
def test_a_dead_engine_fails_its_streams_and_every_new_request_with_503_at_once(
        tmp_path: Path) -> None:
    # The default heartbeat (1 s): ten silent heartbeats are 10 s, which is how long the
    # stream's error took before (10.1 s measured); the engine's closed connection says at once
    # that it died (under 0.1 s measured). The engine's failure is not the client's bad request:
    # the stream's error event says 503 (ServiceUnavailableError), as a plain request to a dead
    # engine does, then [DONE]. While the supervisor restarts the engine (/health 503), a new
    # request is refused with a 503 status at once, a stream before its 200: before, a stream
    # got 200 and an empty body after 10 s and a plain request its 503 after 10 s (the server's
    # client waited for a handshake no engine answered), each with ~80 lines of traceback in
    # the log. The server serves again once the supervisor restarted the engine.
    with EngineProcess(["--num-kv-blocks", "300", "--block-size", "8", "--restart-backoff",
                        "2"], endpoints=ipc_endpoints(tmp_path)) as engine:
        child, port, log = serve(tmp_path, "--engine-ready-file", str(engine.ready_path))
        try:
            wait_until(lambda: status(port) == 200, "the server never became healthy", log)
            events, took = stream_and_kill(port, engine)
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert (error["code"], error["type"]) == (503, "ServiceUnavailableError"), error
            assert error["message"].startswith("engine unreachable")
            assert took < 5.0, f"the stream's error came {took:.1f} s after the engine died"
            # /health follows the crash and the restart (the server in front of a running
            # engine, by its ready file)
            wait_until(lambda: status(port) == 503, "/health stayed 200 with the engine dead",
                       log, timeout_s=60)
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                              max_retries=0, timeout=30)
            answers = refused_while_down(c)
            assert [code for _, code, _ in answers] == [503] * 4, answers
            assert all(s < 3.0 for _, _, s in answers), answers
            wait_until(lambda: status(port) == 200, "/health never came back after the "
                       "supervisor restarted the engine", log, timeout_s=120)
            r = c.completions.create(model="tiny", prompt="again", max_tokens=3)
            assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens == len("again")
            assert engine.read_restarts() == 1
            load = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{port}/load", timeout=10).read())
            assert load == {"server_load": 0}            # the cut stream is not counted
        finally:
            child.stop(30, signal.SIGINT)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    # one line each: the cut stream's (its access line says 200), the refusals' access lines
    assert text.count("stream ended by a 503: engine unreachable") == 1, text[-3000:]
    assert text.count('/v1/completions HTTP/1.1" 503') == 2, text[-3000:]
    assert text.count('/v1/chat/completions HTTP/1.1" 503') == 2, text[-3000:]


@pytest.mark.proc
def test_a_taken_port_is_one_line_and_exit_2_before_any_engine_starts(tmp_path: Path) -> None:
    # Before: the model loaded (11-42 s), the server said it served, uvicorn logged errno 98,
    # the engine was stopped and the command exited 3. Now the port is bound first.
    eps = ipc_endpoints(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "vconsole", "serve", "--port", str(port),
                               *[f"--{n}={ep}" for n, ep in eps.items()]],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"vconsole serve: port {port} on 127.0.0.1 is in use (Address already in use): stop "
        "what listens there or choose another --port"]
    assert done.stdout == "" and took < 30                      # no model was loaded
    assert not any(eps["input"] in arg for p in psutil.process_iter(["cmdline"])
                   for arg in p.info["cmdline"] or ())         # no engine was started


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_needs_no_key(host: str) -> None:
    check_http_host(host, api_key=False, open_without_key=False)


@pytest.mark.proc
def test_beyond_loopback_the_server_wants_a_key_or_an_explicit_open_flag(
        tmp_path: Path) -> None:
    with pytest.raises(RemoteBindRefused, match="--api-key"):
        check_http_host("0.0.0.0", api_key=False, open_without_key=False)
    check_http_host("0.0.0.0", api_key=True, open_without_key=False)
    check_http_host("0.0.0.0", api_key=False, open_without_key=True)
    # The command refuses before it starts any engine.
    done = subprocess.run([sys.executable, "-m", "vconsole", "serve", "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "VCONSOLE_API_KEY": ""})
    assert done.returncode == 2 and "--allow-no-api-key" in done.stderr
    assert "starting the engine" not in done.stderr


@pytest.mark.proc
@pytest.mark.slow
def test_serve_on_a_local_qwen2_directory_streams_what_it_answers(tmp_path: Path) -> None:
    """A Qwen2 directory (random weights, saved and loaded by path like a downloaded one): the
    SDK's completions and chat calls work, and a greedy stream's text is the plain answer's."""
    from support.local_models import qwen2_config, save_random_model

    model_dir = save_random_model(tmp_path / "qwen2-local", qwen2_config(24))
    child, port, log = serve(tmp_path, "--model", str(model_dir), *ENGINE)
    try:
        wait_until(lambda: status(port) == 200, "the server never became healthy", log)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == [str(model_dir)]  # as vLLM: --model
        ask = dict(model=str(model_dir), max_tokens=24, temperature=0)
        prompt = "The quick brown fox " * 4           # longer than the 24-token window
        plain = c.completions.create(prompt=prompt, **ask).choices[0].text
        streamed = "".join(ch.choices[0].text for ch in
                           c.completions.create(prompt=prompt, stream=True, **ask)
                           if ch.choices)
        assert plain and streamed == plain
        msgs = [{"role": "user", "content": "hello there"}]
        answer = c.chat.completions.create(messages=msgs, **ask).choices[0].message.content
        chunks = "".join(ch.choices[0].delta.content or "" for ch in
                         c.chat.completions.create(messages=msgs, stream=True, **ask)
                         if ch.choices)
        assert answer and chunks == answer
        child.send_signal(signal.SIGINT)
        assert child.wait(60) == 0, log.read_text()[-3000:]
    finally:
        child.kill()
