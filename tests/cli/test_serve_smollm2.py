"""`vconsole serve --model smollm2` answers the openai SDK's chat request with sensible text: the
real model, its chat template and greedy decoding end to end, as a user would first try it."""

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
from pathlib import Path

import openai
import pytest

from support.live_engine import ipc_endpoints
from vconsole.cli import build_parser
from vconsole.commands import load as load_cmd
from vconsole.engine.launch.child import ChildProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.HTTPError, OSError):
        return False


def test_serve_smollm2_knows_the_capital_of_france(tmp_path: Path, smollm2_dir, capsys) -> None:
    port, log = _free_port(), tmp_path / "serve.log"
    eps = [f"--{name}={ep}" for name, ep in ipc_endpoints(tmp_path).items()]
    with open(log, "wb") as out:
        child = ChildProcess([sys.executable, "-m", "vconsole", "serve", "--model", "smollm2",
                              "--port", str(port), "--num-kv-blocks", "64", *eps],
                             stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = reply.choices[0].message.content or ""
        assert "Paris" in text, text
        assert reply.choices[0].finish_reason == "stop"       # it ended its turn by itself
        # the load generator's text prompts, through the same server (its chat template read
        # from the model directory /v1/models names)
        args = build_parser().parse_args(["load", "--api-url", f"http://127.0.0.1:{port}",
                                          "--prompts", "chat", "--num", "3",
                                          "--output-len", "8", "--json"])
        assert load_cmd.main(args) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["completed"] == 3 and summary["failed"] == 0
        child.send_signal(signal.SIGINT)
        assert child.wait(60) == 0, log.read_text()[-3000:]
    finally:
        child.kill()
