"""ChildProcess: one engine-side child process, from spawn to the last exit code.

Every launcher of an engine process goes through this class: the supervisor (its engine child),
`vconsole.engine.launch.engine_process.EngineProcess` (the demo, the benchmarks, the tests
and ``vconsole serve``), and through the supervisor the data-parallel launcher's ranks. It does four things
and nothing else:

- **spawn** a command (``stdin`` closed; stdout/stderr where the caller says), optionally in a
  session of its own so a stop reaches everything it started; on Linux the child gets SIGTERM
  if this process dies first (``PR_SET_PDEATHSIG``, `parent_death_signal`);
- **wait for its ready file** (`vconsole.wire.ready_file`): the record whose ``pid`` is
  this child's, or None once the child exited first;
- **signal** it (its process group when it has one);
- **stop** it: a signal (SIGTERM: it drains), a grace period, then SIGKILL.

Invariant: after `stop` or `kill` returns, the child has exited and been reaped (and, in a
session of its own, everything left in its group got SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from vconsole.wire.ready_file import read_ready_file

READY_POLL_S = 0.05


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], Any] | None:
    """A preexec_fn that asks Linux to send ``sig`` to the child when its parent dies; None
    elsewhere. libc is resolved here, in the parent, so the child makes one system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, sig)


def engine_command(argv: Sequence[str]) -> list[str]:
    """``python -m vconsole engine ARGV`` with this interpreter."""
    return [sys.executable, "-m", "vconsole", "engine", *argv]


class ChildProcess:
    """See the module docstring. ``own_group``: the child leads a new session (a stop signals
    the whole group); else it shares this process's group, as a supervisor's child does."""

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str] | None = None,
                 stdout: IO[Any] | int | None = None, stderr: IO[Any] | int | None = None,
                 own_group: bool = False) -> None:
        self.command = list(command)
        self.own_group = own_group
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            env=None if env is None else dict(env), start_new_session=own_group,
            preexec_fn=parent_death_signal())

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit code, or None if it still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, ready_file: str | os.PathLike[str], timeout_s: float | None = None,
                   *, stop_waiting: Callable[[], bool] = lambda: False
                   ) -> dict[str, Any] | None:
        """This child's ready record, once the file holds it; None when the child exited
        first, ``timeout_s`` passed or ``stop_waiting()`` says so. Raises
        `vconsole.wire.ready_file.ReadyFileError` for a file that is not a record."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        path = Path(ready_file)
        while True:
            exited = self.wait(READY_POLL_S) is not None
            record = read_ready_file(path)
            if record is not None and record["pid"] == self.pid:
                return record
            if exited or stop_waiting() or (deadline is not None
                                            and time.monotonic() >= deadline):
                return None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child (its whole group when it has one) while it runs."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)

    def stop(self, grace_s: float, sig: int = signal.SIGTERM) -> int:
        """``sig``, up to ``grace_s`` for the child to exit, then SIGKILL; its exit code."""
        if self.proc.poll() is None:
            self.send_signal(sig)
            if self.wait(grace_s) is None:
                self.kill()
        return self.kill()

    def kill(self) -> int:
        """SIGKILL now (and whatever is left in its group); its exit code once reaped."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        code = self.proc.wait()
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return code
