"""`vconsole serve` as a process, as a user starts it: on a free loopback port, its output in a
log file; and the small waits its tests share (its /health status, a condition with the log
shown when it never comes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from support.ports import free_port  # noqa: F401  (its users import it from here)
from vconsole.engine.launch.child import ChildProcess

# A small engine pool with a fast heartbeat: the engine a served test starts.
ENGINE = ["--num-kv-blocks", "64", "--block-size", "8", "--set", "heartbeat_interval_s=0.2"]


def status(port: int, path: str = "/health") -> int:
    """The HTTP status of ``path`` on the server; 0 while nothing listens (yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0                                  # not listening (yet)


def wait_until(cond: Callable[[], bool], what: str, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}; log:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def serve(tmp_path: Path, *args: str) -> tuple[ChildProcess, int, Path]:
    """`vconsole serve --port P ARGS` started (not waited for): the child, P and its log."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        child = ChildProcess([sys.executable, "-m", "vconsole", "serve", "--port", str(port),
                              *args], stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return child, port, log
