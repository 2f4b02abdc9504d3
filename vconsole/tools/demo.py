"""`vconsole demo`: an engine process, a varying load and the console, started and stopped as one.

`EngineProcess` runs ``vconsole engine`` as a child in its own process group and learns the
endpoints it actually bound and its control key file from its ready file
(`vconsole.engine.proc.ready_file`), never from its log (the engine binds
``tcp://127.0.0.1:*`` when no ``--base-port`` is given, so two demos or test runs never race for
a port). `DemoStack` adds the
load generator (a thread in this process) and is what `main`, the tests and
``scripts/screenshots.py`` use; the console itself is imported only in `main`, so the process
management is testable without a terminal.

Invariant: when `DemoStack` (or `EngineProcess`) exits — normally, on Ctrl-C, or because the
console crashed — nothing it started is left running: the load thread is stopped, the engine's
process group gets SIGTERM (clean drain), then SIGKILL if it has not exited in time. On Linux
the engine also gets SIGTERM if this process dies without cleaning up (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vconsole.engine.proc.ready_file import (
    ENDPOINT_NAMES,
    ReadyFileError,
    read_ready_file,
)
from vconsole.engine.proc.supervisor import parent_death_signal
from vconsole.tools.loadgen import LoadThread, demo_rate, demo_spec

STOP_GRACE_S = 10.0
# The demo's engine: small enough that bursts fill the KV pool and preempt, with priorities to
# show (`vconsole bench soak` runs the same).
DEMO_ENGINE_DEFAULTS = {"num_kv_blocks": 128, "max_num_seqs": 16, "policy": "hybrid"}
DEMO_ENGINE_ARGS = [arg for key, value in DEMO_ENGINE_DEFAULTS.items()
                    for arg in (f"--{key.replace('_', '-')}", str(value))]


def demo_engine_env(data_parallel_size: int = 1) -> dict[str, str]:
    """The demo engine's environment: on a CPU, one core is left to the console and the load
    generator, which share the machine with it by design (torch's OpenMP threads, one per
    core, slow down many times over when another process takes a core: the step-time alert
    then flaps). A data-parallel group splits the cores itself; ``OMP_NUM_THREADS`` set by
    the user wins."""
    cores = os.cpu_count() or 1
    if data_parallel_size > 1 or "OMP_NUM_THREADS" in os.environ or cores < 2:
        return {}
    return {"OMP_NUM_THREADS": str(cores - 1)}


def loopback_endpoints(base_port: int = 0) -> dict[str, str]:
    """Four consecutive loopback ports from ``base_port``, or ``*`` (engine picks free ones)."""
    if base_port:
        return {n: f"tcp://127.0.0.1:{base_port + i}" for i, n in enumerate(ENDPOINT_NAMES)}
    return dict.fromkeys(ENDPOINT_NAMES, "tcp://127.0.0.1:*")


class EngineProcess:
    """``vconsole engine`` as a child process; its stdout and stderr go to ``log_path``.

    Without a ``log_path`` the log is a temporary file, removed by `stop` after a clean exit
    (code 0) and kept when the engine failed (``failed``: it did not start, exited non-zero,
    or its supervisor restarted it: ``restart_count`` and ``restart_reason``, read from the
    ready file the supervisor rewrites at each restart)."""

    def __init__(self, engine_args: Sequence[str] = (), *,
                 endpoints: dict[str, str] | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.engine_args = list(engine_args)
        self.requested = endpoints or loopback_endpoints()
        self.endpoints: dict[str, str] = {}
        self.keep_log = log_path is not None
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix="vconsole-engine-", suffix=".log")
            os.close(fd)  # only the child writes it, through its own open()
            log_path = tmp
        self.log_path = Path(log_path)
        self.failed = False
        self.restart_count = 0
        self.restart_reason: str | None = None
        self._run_dir = Path(tempfile.mkdtemp(prefix="vconsole-engine-run-"))
        self.ready_path = self._run_dir / "ready.json"
        self.ready: dict[str, Any] = {}
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def control_key_path(self) -> Path | None:
        """The engine's control key file, as its ready file names it (once started)."""
        path = self.ready.get("control_key_file")
        return Path(path) if path else None

    def control_key(self) -> str | None:
        """The engine's control key (same machine, same user), None if unreadable."""
        from vconsole.security.control_key import load_control_key
        path = self.control_key_path
        return load_control_key(self.endpoints.get("control", ""), path) if path else None

    def start(self, timeout_s: float = 120.0) -> EngineProcess:
        """Start and wait for the engine's ready file; raises RuntimeError (with the log's
        tail) if the engine exits or is not ready in time."""
        cmd = [sys.executable, "-m", "vconsole", "engine", *self.engine_args,
               "--ready-file", str(self.ready_path)]
        for name, ep in self.requested.items():
            cmd += [f"--{name}", ep]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True,
                                         preexec_fn=parent_death_signal())
        deadline = time.monotonic() + timeout_s
        why = ""
        while time.monotonic() < deadline:
            try:
                record = read_ready_file(self.ready_path)
            except ReadyFileError as e:
                why = str(e)
                break
            if record is not None and record["pid"] == self.proc.pid:
                self.ready = record
                self.endpoints = {n: record["endpoints"][n] for n in ENDPOINT_NAMES}
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        code = self.proc.poll()
        self.failed = True  # keep the log: the error below points at it
        self.stop()
        why = why or (f"exited with code {code}" if code is not None
                      else f"not ready in {timeout_s:g} s")
        raise RuntimeError(f"the engine {why}; log {self.log_path}:\n{self.log_tail()}")

    def read_restarts(self) -> int:
        """How often the supervisor restarted the engine so far (also kept in
        ``restart_count`` / ``restart_reason``)."""
        with contextlib.suppress(ReadyFileError, OSError):
            record = read_ready_file(self.ready_path)
            if record is not None and isinstance(record.get("restart_count"), int):
                self.restart_count = record["restart_count"]
                self.restart_reason = record.get("restart_reason")
        return self.restart_count

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the process group, wait, SIGKILL it if needed; returns the exit code.
        A temporary log is removed here unless the engine failed."""
        if self.proc is None:
            self._drop_log()
            return None
        self.read_restarts()
        if self.proc.poll() is None:
            self._kill_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self.proc.wait()
        self._kill_group(signal.SIGKILL)  # anything the engine itself left in its group
        if self.proc.returncode != 0 or self.restart_count:
            self.failed = True
        self._drop_log()
        return self.proc.returncode

    def _drop_log(self) -> None:
        shutil.rmtree(self._run_dir, ignore_errors=True)
        if not self.keep_log and not self.failed:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def _kill_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DemoStack:
    """Engine process + load thread. Use as a context manager; see the module invariant."""

    def __init__(self, engine_args: Sequence[str] = (), *, rate: float = 4.0,
                 base_port: int = 0, load: bool = True, log_path: str | Path | None = None,
                 seed: int = 0) -> None:
        self.engine = EngineProcess(engine_args, endpoints=loopback_endpoints(base_port),
                                    env=demo_engine_env(),
                                    log_path=log_path)
        self.rate = rate
        self.load_enabled = load
        self.seed = seed
        self.load: LoadThread | None = None

    @property
    def endpoints(self) -> dict[str, str]:
        return self.engine.endpoints

    def start(self) -> DemoStack:
        try:
            self.engine.start()
            if self.load_enabled:
                self.load = LoadThread(self.endpoints["input"], self.endpoints["output"],
                                       demo_spec(self.seed), rate_fn=demo_rate(self.rate))
                self.load.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            if self.load is not None:
                self.load.stop()
        finally:
            self.engine.stop()

    def __enter__(self) -> DemoStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
