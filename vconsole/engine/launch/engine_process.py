"""EngineProcess: ``vconsole engine`` as a child, for whoever needs a whole engine to talk to.

The demo (`vconsole.tools.demo.DemoStack`), the benchmarks, the tests and ``vconsole serve`` run
their engine through this class. It starts ``python -m vconsole engine ARGS`` in a session of
its own (`vconsole.engine.launch.child.ChildProcess`) and learns the endpoints it actually bound
and its control key file from its ready file (`vconsole.wire.ready_file`), never from its
log: the engine binds ``tcp://127.0.0.1:*`` when no port is given, so two demos or test runs
never race for a port.

Invariant: after `stop` (or leaving the ``with`` block) nothing it started is left running: the
process group gets SIGTERM (the supervisor passes it on, the engine drains), then SIGKILL if it
has not exited in ``grace_s``. On Linux the engine also gets SIGTERM if this process dies
without cleaning up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vconsole.engine import kernel_cache
from vconsole.engine.launch.child import ChildProcess, engine_command
from vconsole.wire.ready_file import ENDPOINT_NAMES, ReadyFileError, read_ready_file

STOP_GRACE_S = 10.0
PHASE_POLL_S = 0.5


def loopback_endpoints(base_port: int = 0) -> dict[str, str]:
    """Four consecutive loopback ports from ``base_port``, or ``*`` (engine picks free ones)."""
    if base_port:
        return {n: f"tcp://127.0.0.1:{base_port + i}" for i, n in enumerate(ENDPOINT_NAMES)}
    return dict.fromkeys(ENDPOINT_NAMES, "tcp://127.0.0.1:*")


def engine_env_beside_clients(data_parallel_size: int = 1) -> dict[str, str]:
    """The environment of an engine that shares a CPU-only machine with its clients by design
    (the demo's console and load, `vconsole serve`'s HTTP server, a benchmark's client): one
    core is left to them. torch's OpenMP threads, one per core, spin-wait for each other;
    when another busy process takes a core they slow down many times over (measured on 2
    cores: native output tokens/s 327 alone, 50 beside two busy processes). A data-parallel
    group splits the cores itself; ``OMP_NUM_THREADS`` set by the user wins; a GPU engine's
    host threads hardly matter."""
    cores = os.cpu_count() or 1
    if data_parallel_size > 1 or "OMP_NUM_THREADS" in os.environ or cores < 2:
        return {}
    if os.path.exists("/dev/nvidia0"):   # a GPU machine (no torch import here: it is slow)
        return {}
    return {"OMP_NUM_THREADS": str(cores - 1)}


class EngineProcess:
    """``vconsole engine`` as a child process; its stdout and stderr go to ``log_path``.

    Without a ``log_path`` the log is a temporary file, removed by `stop` after a clean exit
    (code 0) and kept when the engine failed (``failed``: it did not start, exited non-zero,
    or its supervisor restarted it: ``restart_count`` and ``restart_reason``, read from the
    ready file the supervisor rewrites at each restart)."""

    def __init__(self, engine_args: Sequence[str] = (), *,
                 endpoints: dict[str, str] | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, inherit_output: bool = False,
                 on_phase: Callable[[str], None] | None = None) -> None:
        """``inherit_output``: the engine writes to this process's stderr (``vconsole serve``)
        and there is no log file. ``on_phase(text)``: told once, while `start` waits, that the
        engine is compiling the CPU attention kernel (its first start on this machine, 20-40 s
        of otherwise silent waiting); the demo prints it."""
        self.engine_args = list(engine_args)
        self.requested = endpoints or loopback_endpoints()
        self.endpoints: dict[str, str] = {}
        self.inherit_output = inherit_output
        self.keep_log = log_path is not None or inherit_output
        self.log_path = Path(os.devnull if log_path is None and inherit_output
                             else log_path or os.devnull)
        self.failed = False
        self.restart_count = 0
        self.restart_reason: str | None = None
        self._run_dir = Path()
        self.ready_path = Path()
        self.ready: dict[str, Any] = {}
        self._fresh_run()
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    **(env or {})}
        self.child: ChildProcess | None = None
        self.on_phase = on_phase
        self.phase: str | None = None        # what the engine was found doing while starting
        self._next_phase_poll = 0.0

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None

    @property
    def control_key_file(self) -> Path | None:
        """The engine's control key file, as its ready file names it (once started)."""
        path = self.ready.get("control_key_file")
        return Path(path) if path else None


    def control_key(self) -> str | None:
        """The engine's control key (same machine, same user), None if unreadable."""
        from vconsole.security.control_key import load_control_key
        path = self.control_key_file
        return load_control_key(self.endpoints.get("control", ""), path) if path else None

    def start(self, timeout_s: float = 120.0) -> EngineProcess:
        """Start and wait for the engine's ready file; raises RuntimeError (with the log's
        tail) if the engine exits or is not ready in time, or if this one's engine is running
        already (a second start would leave the first running, unwatched); after `stop` it
        starts again."""
        if self.child is not None and self.child.poll() is None:
            raise RuntimeError("this EngineProcess was started already and is running")
        if self.child is not None:      # a restart after stop: a run of its own
            self._fresh_run()
        argv = [*self.engine_args, "--ready-file", str(self.ready_path)]
        for name, ep in self.requested.items():
            argv += [f"--{name}", ep]
        if self.inherit_output:     # all of it on stderr: stdout is the caller's own
            self.child = ChildProcess(engine_command(argv), env=self.env, own_group=True,
                                      stdout=sys.stderr.fileno())
        else:
            with open(self.log_path, "wb") as log:
                self.child = ChildProcess(engine_command(argv), env=self.env, stdout=log,
                                          stderr=log, own_group=True)
        why = ""
        try:
            record = self.child.wait_ready(self.ready_path, timeout_s,
                                           stop_waiting=self._watch_phase)
        except ReadyFileError as e:
            record, why = None, str(e)
        if record is not None:
            self.ready = record
            self.endpoints = {n: record["endpoints"][n] for n in ENDPOINT_NAMES}
            return self
        code = self.child.poll()
        self.failed = True  # keep the log: the error below points at it
        self.stop()
        why = why or (f"exited with code {code}" if code is not None
                      else f"not ready in {timeout_s:g} s")
        raise RuntimeError(f"the engine {why}; log {self.log_path}:\n{self.log_tail()}")

    def _watch_phase(self) -> bool:
        """Polled while waiting for the ready file (never stops the wait): a kernel build in
        the engine's cache (`kernel_cache.build_in_progress`: a file read, no torch) is
        the one long silent phase of a start, so it is named once."""
        now = time.monotonic()
        if self.on_phase is None or self.phase is not None or now < self._next_phase_poll:
            return False
        self._next_phase_poll = now + PHASE_POLL_S
        if kernel_cache.build_in_progress(kernel_cache.cache_root(self.env)):
            self.phase = kernel_cache.COMPILING
            self.on_phase(self.phase)
        return False

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
        """``sig`` to the engine's top process only (its supervisor, unless
        ``--no-supervisor``)."""
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the process group, wait, SIGKILL it if needed; returns the exit code.
        A temporary log is removed here unless the engine failed."""
        if self.child is None:
            self._drop_log()
            return None
        self.read_restarts()
        code = self.child.stop(grace_s)
        if code != 0 or self.restart_count:
            self.failed = True
        self._drop_log()
        return code

    def _fresh_run(self) -> None:
        """One run's own state: a private folder for its ready file, a temporary log of its
        own (unless the log is the caller's), nothing failed or restarted yet. A start after
        `stop` gets new ones: the old folder was removed, and its path, in the first child's
        argv for every local user to see, must not be trusted again."""
        if not self.keep_log:
            fd, tmp = tempfile.mkstemp(prefix="vconsole-engine-", suffix=".log")
            os.close(fd)  # only the child writes it, through its own open()
            self.log_path = Path(tmp)
        self.failed = False
        self.restart_count = 0
        self.restart_reason = None
        self._run_dir = Path(tempfile.mkdtemp(prefix="vconsole-engine-run-"))
        self.ready_path = self._run_dir / "ready.json"
        self.ready = {}
        self.phase = None

    def _drop_log(self) -> None:
        shutil.rmtree(self._run_dir, ignore_errors=True)
        if not self.keep_log and not self.failed:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> EngineProcess:
        """Starts the engine unless ``start`` was called already (``with
        EngineProcess(args).start(timeout_s=300) as engine:``)."""
        return self if self.child is not None and self.child.poll() is None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
