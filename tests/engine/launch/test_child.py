"""ChildProcess: spawn, the ready file, stop — with real child processes (no engine needed)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from vconsole.engine.launch.child import ChildProcess
from vconsole.wire.ready_file import ready_record, write_ready_file

EPS = {n: f"ipc:///tmp/x-{n}" for n in ("input", "output", "telemetry", "control")}


def python(code: str, **kw: object) -> ChildProcess:
    return ChildProcess([sys.executable, "-c", code], **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """Running (a zombie left for init to reap is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_wait_ready_returns_the_record_written_by_this_child(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    write_ready_file(ready, ready_record(engine_id="old", pid=1, endpoints=EPS,
                                         control_key_file="k"))  # a stale file, another pid
    child = python(
        "import os, sys, time\n"
        "from vconsole.wire.ready_file import ready_record, write_ready_file\n"
        "time.sleep(0.3)\n"
        f"write_ready_file({str(ready)!r}, ready_record(engine_id='new', pid=os.getpid(), "
        f"endpoints={EPS!r}, control_key_file='k'))\n"
        "time.sleep(60)\n")
    try:
        record = child.wait_ready(ready, timeout_s=60)
        assert record is not None and record["engine_id"] == "new"
        assert record["pid"] == child.pid
    finally:
        assert child.stop(5) == -signal.SIGTERM
    assert child.poll() is not None


def test_wait_ready_gives_none_when_the_child_exits_first(tmp_path: Path) -> None:
    child = python("import sys; sys.exit(3)")
    assert child.wait_ready(tmp_path / "never.json", timeout_s=60) is None
    assert child.returncode == 3


def test_wait_ready_gives_up_when_told_to(tmp_path: Path) -> None:
    child = python("import time; time.sleep(60)")
    try:
        calls = []
        assert child.wait_ready(tmp_path / "never.json",
                                stop_waiting=lambda: calls.append(1) or len(calls) > 2) is None
        assert child.poll() is None and len(calls) == 3
    finally:
        child.kill()


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    marker = tmp_path / "armed"
    child = python("import signal, time, pathlib\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   f"pathlib.Path({str(marker)!r}).touch()\n"
                   "time.sleep(60)\n")
    while not marker.exists():
        assert child.poll() is None
        time.sleep(0.02)
    assert child.stop(0.5) == -signal.SIGKILL


def test_stop_of_its_own_group_leaves_no_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    child = python("import subprocess, sys, time, pathlib\n"
                   "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
                   "time.sleep(60)\n", own_group=True)
    while not pid_file.exists() or not pid_file.read_text():
        assert child.poll() is None
        time.sleep(0.02)
    grandchild = int(pid_file.read_text())
    assert alive(grandchild)
    child.stop(5)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(grandchild)
