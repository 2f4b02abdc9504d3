"""The two HTTP servers `bench throughput --peer llama-server` drives: ``vconsole serve --model
<GGUF>`` and llama.cpp's ``llama-server`` on the same file, each started as a child process with
the bench's threads, and waited for until ``/health`` answers 200 (llama-server answers 503
while it loads).

Threads: ``vconsole serve`` gives its engine ``OMP_NUM_THREADS`` when the user set it, so the
bench sets it to ``threads``; llama-server gets ``--threads`` and ``--threads-batch``. Its slots
are ``--parallel`` (the concurrency being measured) in one unified KV cache (``--kv-unified``)
that holds every slot's prompt and output, with ``--metrics`` on so its own token counter
checks the client's count.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vconsole.engine.launch.child import ChildProcess

START_S = 900.0          # the first `vconsole serve` of a GGUF converts it (minutes when busy)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    """A server exited (``returncode``) or never became healthy (None); the message ends with
    its log's tail."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def wait_healthy(url: str, child: ChildProcess, log: Path, name: str,
                 timeout_s: float = START_S) -> None:
    """Until ``url``'s ``/health`` answers 200; `ServerFailed` naming ``name`` with ``log``'s
    tail when ``child`` exits first or ``timeout_s`` passes (`bench throughput`'s servers and
    `bench serve`'s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise ServerFailed(f"{name} exited ({child.returncode}): "
                               f"{log.read_text(errors='replace')[-2000:]}", child.returncode)
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise ServerFailed(f"{name} was not healthy within {timeout_s:.0f} s: "
                       f"{log.read_text(errors='replace')[-2000:]}")


@dataclass(frozen=True)
class Started:
    url: str             # http://127.0.0.1:PORT (the OpenAI base is url + "/v1")
    log: Path


@contextlib.contextmanager
def vconsole_serve(gguf: Path, port: int, threads: int, work: Path,
                   quantization: str | None = None,
                   engine_base_port: int | None = None) -> Iterator[Started]:
    """``vconsole serve --model <gguf>`` with its defaults, its engine on ``threads`` threads."""
    cmd = [sys.executable, "-m", "vconsole", "serve", "--model", str(gguf), "--port", str(port)]
    if quantization:
        cmd += ["--quantization", quantization]
    if engine_base_port:
        cmd += ["--base-port", str(engine_base_port)]
    else:       # free ports, chosen by the engine (never another engine's defaults)
        for flag in ("--input", "--output", "--telemetry", "--control"):
            cmd += [flag, "tcp://127.0.0.1:*"]
    log = work / "vconsole-serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    with open(log, "wb") as out:
        child = ChildProcess(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, own_group=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, child, log, "vconsole serve")
        yield Started(url, log)
    finally:
        child.stop(30)


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                         ctx_per_slot: int, repack: bool = True) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(parallel), "--kv-unified", "--ctx-size",
            str(parallel * ctx_per_slot), "--metrics", "--no-webui",
            *(() if repack else ("--no-repack",))]


def died_of_sigill(e: ServerFailed) -> bool:
    """ggml's repacked weight buffers include AMX's on a CPU that names AMX; a VM that does not
    grant the AMX tile state kills the server with SIGILL on its first tile load."""
    return e.returncode == -signal.SIGILL


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                 ctx_per_slot: int, work: Path, repack: bool = True) -> Iterator[Started]:
    """``llama-server`` on ``gguf`` with ``parallel`` slots of ``ctx_per_slot`` tokens each;
    ``repack=False``: ``--no-repack`` (ggml's plain CPU buffers, no extra buffer types)."""
    log = work / f"llama-server-{parallel}.log"
    with open(log, "wb") as out:
        child = ChildProcess(llama_server_command(binary, gguf, port, threads, parallel,
                                                  ctx_per_slot, repack),
                             stdout=out, stderr=subprocess.STDOUT, own_group=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, child, log, "llama-server", timeout_s=300)
        yield Started(url, log)
    finally:
        child.stop(30)


def system_info(binary: Path, threads: int) -> str | None:
    """llama-server's ``system_info:`` line (its threads and the CPU features ggml was built
    with and uses). It logs the line at trace level only, so a second server prints it at
    ``-lv 4`` and exits at once on a model file that is not there."""
    try:
        out = subprocess.run([str(binary), "-lv", "4", "-m", "/nonexistent/system-info.gguf",
                              "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
                              "--threads-batch", str(threads)],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if "system_info:" in line:
            return line.split("system_info:", 1)[1].strip().rstrip("| ").strip()
    return None


def scrape_counter(url: str, name: str) -> float | None:
    """One unlabelled sample of ``name`` on ``url``'s ``/metrics`` (None when absent)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None
