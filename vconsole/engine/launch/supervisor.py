"""EngineSupervisor: `vconsole engine` keeps its engine process alive across crashes.

The supervisor is the process `vconsole engine` starts (unless ``--no-supervisor``); it loads no
model and touches no GPU. It runs the engine, `EngineCoreProc`, as a child
(``python -m vconsole engine ... --supervised-child``) and waits on it. When the child dies —
an exception that ended it, ``kill -9``, the kernel's OOM killer, or exit code 3 after
``max_consecutive_step_failures`` failed steps in a row — it starts another after a backoff
(`RestartPolicy`: 0.5 s, doubling, at most 10 s) on the *same* endpoints: the ``*`` ports of the
first start are taken from the first child's ready file and passed to every later child, so
clients and consoles reconnect where they were. While no child runs, the supervisor binds the telemetry
endpoint itself (`vconsole.engine.publish.beacon.HealthBeacon`) and publishes ``health``
with state ``restarting``, ``restart_reason`` ("killed by SIGKILL", "exit code 1") and
``restart_count``, then closes it before the next child starts (telemetry is then silent while
that child loads its model, until its own publisher binds); that child's own ``health`` carries
the same count and reason. The requests the dead child held are lost with it; clients send them
again. With ``metrics`` (``--metrics-port``) the public ``/metrics`` port is the supervisor's
(`vconsole.engine.launch.metrics_relay`): each child serves a private loopback port, and a scrape
while no child answers gets the last figures with ``vconsole:engine_up 0``.

A child that hangs without dying — alive, work pending, no pass of its busy loop for
``hang_timeout_s`` (`vconsole.wire.liveness`: the child stamps a shared file on every
pass) — is killed (SIGKILL) and restarted like one that died, with reason
``hung: no step for N s in FUNCTION; stacks: PATH``. ``hang_timeout_s`` None or 0: never.
Before the kill it captures every thread's stack of the child (`vconsole.shared.stacks`:
py-spy where the OS lets it read the child, else the child's own SIGUSR2 dump), writes them to
the engine log (this process's stderr) and to ``PATH`` (`stacks.hang_dir`), and names the busy
loop's innermost function in the reason, so the restart event says where it hung.

It gives up — exit code `exit_codes.GAVE_UP`, a message saying how often and why — after more
than ``max_restarts`` failures within ``window_s``. It never restarts a start that cannot
succeed: a child that exits with `exit_codes.CANNOT_START` (invalid config, a port it may not or
cannot bind), or one that fails before the first child ever became ready (a model that does not
load would fail the same way every time); it exits with the child's code. Each error is printed
once: a child that knows why it cannot go on writes the reason to its failure file instead of
stderr, and the supervisor's last line carries it.

Signals: SIGTERM and SIGINT are passed on to the child, which stops (aborting what is in flight) and exits 0; the supervisor
then exits 0 and starts nothing. A second one kills the child (SIGKILL). SIGHUP is passed on
(the child reloads ``--config``). The child shares the supervisor's process group, so a
launcher that signals the group (`vconsole.engine.launch.engine_process.EngineProcess`) reaches
both: a supervised child stops on the first SIGTERM/SIGINT and ignores repeats, leaving
escalation to the supervisor. The child also gets SIGTERM if the supervisor dies (Linux ``PR_SET_PDEATHSIG``).

Ready file: the child writes its record to a private path; the supervisor republishes it at
``ready_file`` with its *own* ``pid`` (the process a launcher started and checks) plus
``child_pid``, ``restart_count`` and ``supervised``, rewrites it when a restarted child is ready
(same endpoints), and removes it when it exits.

Data parallel (`vconsole.engine.dp.launcher`): the launcher runs one supervisor per rank,
each in a thread of its own (``run(install_signals=False)``; the launcher's signal handler calls
`EngineSupervisor.stop`), and learns of each child's start and end through ``on_ready(record)``
and ``on_exit(code, reason)``.

Invariant: when `run` returns, no child is left running.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import zmq

from vconsole.engine.launch import stack_dump
from vconsole.engine.launch.child import ChildProcess, engine_command
from vconsole.engine.launch.launch import ChildOfSupervisor
from vconsole.engine.launch.metrics_relay import MetricsRelay
from vconsole.engine.launch.restart_policy import RestartPolicy
from vconsole.engine.publish.beacon import HealthBeacon
from vconsole.shared import stacks
from vconsole.telemetry.alerts import restart_event
from vconsole.wire import exit_codes, liveness
from vconsole.wire.exit_codes import describe_exit
from vconsole.wire.ready_file import (
    ENDPOINT_NAMES,
    ReadyFileError,
    remove_ready_file,
    write_ready_file,
)

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.supervisor")

POLL_S = 0.05             # how often the supervisor looks for the child's ready file / a stop
STDERR_TAIL_LINES = 20    # the child's last stderr lines: did it say anything
STDERR_JOIN_S = 5.0       # after the child exited, how long its stderr may still flow
RESTARTING = "restarting"
LIVENESS_POLL_S = 0.5     # how often the supervisor reads a ready child's liveness stamp


class EngineSupervisor:
    """Runs the engine ``launch`` describes as a child and restarts it; see the module
    docstring. `run` blocks until the supervisor is done and returns its exit code; ``failure``
    then says why, when it gave up.

    The child's command line is ``launch`` for a child (`EngineLaunch.for_child`): a private
    ready file, the restart count and reason, and, once known, the concrete endpoints.
    ``curve``: the engine's CURVE keys (loaded by the caller), so the restarting heartbeats are
    as secure as the engine's own telemetry. ``beacon=False``: no ``restarting`` heartbeats of
    its own (a data-parallel rank's: the front end's telemetry proxy publishes them)."""

    def __init__(self, launch: EngineLaunch, *, env: dict[str, str] | None = None,
                 curve: ServerCurve | None = None, stderr: IO[str] | None = None,
                 on_ready: Callable[[dict[str, Any]], None] | None = None,
                 on_exit: Callable[[int, str], None] | None = None,
                 beacon: bool = True) -> None:
        config, sup = launch.config, launch.supervision
        self.launch = launch
        self.endpoints = {n: launch.endpoints[n] for n in ENDPOINT_NAMES}
        self.engine_id = config.engine_id
        self.rank = config.dp_rank
        self.policy = RestartPolicy(max_restarts=sup.max_restarts, window_s=sup.restart_window_s,
                                    backoff_s=sup.restart_backoff_s)
        self.ready_file = launch.ready_file
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.sndhwm = config.zmq_sndhwm
        self.env = env
        self.curve = curve
        self._stderr = stderr
        self.on_ready = on_ready              # (the child's ready record) once it serves
        self.on_exit = on_exit                # (exit code, reason) each time a child exits
        self.beacon = beacon                  # publish `restarting` while no child runs
        self.hang_timeout_s = sup.hang_timeout_s or None
        self._hung: str | None = None         # why the last child was killed as hung
        self.restart_count = 0
        self.restart_reason: str | None = None
        self.failure: str | None = None      # why `run` gave up, for the caller to print
        self.child_pids: list[int] = []      # every child started, in order
        self._ever_ready = False
        self._child: ChildProcess | None = None
        self._stop_signal: int | None = None  # set by the first SIGTERM/SIGINT
        self._run_dir: Path | None = None     # `run`'s private folder: the child's ready file
        self.metrics = launch.metrics         # (host, port) of the public /metrics, if any
        self._relay: MetricsRelay | None = None
        self._child_metrics: str | None = None  # the serving child's private /metrics URL
        self._last_record: dict[str, Any] | None = None  # the last ready child's record

    # --- the loop --------------------------------------------------------------------------

    def run(self, *, install_signals: bool = True) -> int:
        """Supervise until a clean stop (0), a start that cannot succeed (the child's code) or
        too many failures (`exit_codes.GAVE_UP`). With ``install_signals`` call it from the main
        thread; without (a supervisor per data-parallel rank, each in a thread of the
        launcher), the caller passes stops on with `stop`."""
        self._run_dir = Path(tempfile.mkdtemp(prefix="vconsole-supervisor-"))
        previous: dict[int, Any] = {}
        try:
            if self.metrics is not None:  # OSError (port in use) before any child starts
                self._relay = MetricsRelay(*self.metrics, upstream=lambda: self._child_metrics,
                                           restart_count=lambda: self.restart_count).start()
            previous = self._install_signal_handlers() if install_signals else {}
            return self._supervise()
        finally:
            self._kill_child()
            if self._relay is not None:
                self._relay.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.ready_file is not None:
                remove_ready_file(self.ready_file, os.getpid())
            shutil.rmtree(self._run_dir, ignore_errors=True)

    @property
    def _child_ready_file(self) -> Path:
        assert self._run_dir is not None, "only while `run` runs"
        return self._run_dir / "child-ready.json"

    def _supervise(self) -> int:
        while True:
            code, last_words = self._run_child()
            reason = self._hung or describe_exit(code)
            if self.on_exit is not None:
                self.on_exit(code, reason)
            if self._stop_signal is not None:
                log.info("stopped by %s: the engine %s", signal.Signals(self._stop_signal).name,
                         "drained" if code == exit_codes.OK else describe_exit(code))
                return self._stopped_code(code)
            if code == exit_codes.OK:
                log.info("the engine stopped cleanly (exit code 0)")
                return exit_codes.OK
            # A signal's victim said nothing about it: its last line would only mislead.
            said = f"; {last_words}" if last_words and code > 0 else ""
            if code == exit_codes.CANNOT_START:
                return self._give_up(code, f"the engine cannot start as configured ({reason}), "
                                           f"so it is not restarted{said}")
            if not self._ever_ready:
                return self._give_up(code if code > 0 else exit_codes.FAILED,
                                     f"the engine failed before it was ever ready ({reason}), "
                                     f"so it is not restarted{said}")
            delay = self.policy.on_failure(time.monotonic())
            if delay is None:
                return self._give_up(exit_codes.GAVE_UP, (
                    f"giving up: the engine failed {self.policy.failures_in_window} times "
                    f"within {self.policy.window_s:g} s, more than --max-restarts "
                    f"{self.policy.max_restarts} (last: {reason}){said}"))
            self.restart_count += 1
            self.restart_reason = reason
            self._publish_ready(self._last_record)     # launchers read the count from it
            log.warning("the engine (pid %d) died: %s; restart %d in %.1f s",
                        self.child_pids[-1], reason, self.restart_count, delay)
            self._wait_restarting(delay)
            if self._stop_signal is not None:
                return exit_codes.OK

    def _stopped_code(self, code: int) -> int:
        """The exit code after a requested stop: 0 when the child drained (or died of the very
        signal it was passed before it could install its handlers)."""
        if code in (exit_codes.OK, -(self._stop_signal or 0)):
            return exit_codes.OK
        return 128 - code if code < 0 else code

    def _give_up(self, code: int, message: str) -> int:
        self.failure = message      # the caller prints it: the last line a person reads
        return code

    # --- one child ----------------------------------------------------------------------------

    @property
    def _liveness_file(self) -> Path:
        assert self._run_dir is not None, "only while `run` runs"
        return self._run_dir / "child-liveness"

    @property
    def _failure_file(self) -> Path:
        """Where a child that cannot go on writes why, instead of printing it: the supervisor
        says it once, in its own last line."""
        assert self._run_dir is not None, "only while `run` runs"
        return self._run_dir / "child-failure"

    def _child_command(self) -> list[str]:
        child = ChildOfSupervisor(liveness_file=str(self._liveness_file),
                                  failure_file=str(self._failure_file),
                                  restart_count=self.restart_count,
                                  restart_reason=self.restart_reason)
        private_metrics = ("127.0.0.1", 0) if self._relay is not None else None
        return engine_command(self.launch.for_child(
            child, self.endpoints, ready_file=str(self._child_ready_file),
            metrics=private_metrics).argv())

    def _run_child(self) -> tuple[int, str]:
        """Start a child, announce it once ready, wait for it to exit: its return code and its
        last words (`_last_words`)."""
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._hung = None
        liveness.create(self._liveness_file)
        self._failure_file.unlink(missing_ok=True)
        child = ChildProcess(self._child_command(), env=self.env, stderr=subprocess.PIPE)
        self._child = child
        self.child_pids.append(child.pid)
        if self._stop_signal is not None:     # a stop that came while the child was forking
            child.send_signal(self._stop_signal)
        assert child.proc.stderr is not None
        relay = threading.Thread(target=self._relay_stderr, args=(child.proc.stderr, tail),
                                 name="supervisor-stderr", daemon=True)
        relay.start()
        try:
            if self._wait_ready(child):
                self._watch(child)
        finally:
            if child.poll() is None:          # an exception here: never leave it running
                child.kill()
            relay.join(STDERR_JOIN_S)
            self._child = None
            self._child_metrics = None
            stack_dump.remove_dead(child.pid)     # a killed child left its dump folder
        return child.proc.returncode, self._last_words(tail)

    def _last_words(self, tail: collections.deque[str]) -> str:
        """For the give-up line: what the child said about its end (its failure file, which
        nobody printed), else a pointer to its stderr, which the relay already printed."""
        try:
            said = self._failure_file.read_text().strip()
        except OSError:
            said = ""
        if said:
            return f"it said: {said}"
        return "its output is above" if any(line.strip() for line in tail) else ""

    def _wait_ready(self, child: ChildProcess) -> bool:
        """Wait for the child's ready file; True once it is ready (announced), False if it
        exited first."""
        while True:
            try:
                record = child.wait_ready(self._child_ready_file)
            except ReadyFileError:
                continue                      # not a record (yet): keep waiting
            if record is None:
                return False
            self._announce(record)
            return True

    def _watch(self, child: ChildProcess) -> None:
        """Wait for a ready child to exit; kill it if it hangs (see the module docstring)."""
        while child.wait(LIVENESS_POLL_S) is None:
            if self.hang_timeout_s is None or self._stop_signal is not None:
                continue
            age = liveness.hung_for(self._liveness_file, self.hang_timeout_s)
            if age is not None:
                self._hung = f"hung: no step for {age:.0f} s"
                log.error("the engine (pid %d) is %s with work pending: capturing its stacks, "
                          "then killing it", child.pid, self._hung)
                self._hung += self._capture_stacks(child.pid)
                self._kill_child()

    def _capture_stacks(self, pid: int) -> str:
        """The hung child's stacks into the log and a file; what the reason adds: `` in
        FUNCTION; stacks: PATH`` (as much of it as could be had)."""
        try:
            report = stacks.capture(pid)
        except stacks.StacksError as e:
            log.error("could not capture the hung engine's stacks: %s", e)
            return ""
        text = report.render()
        log.error("stacks of the hung engine (pid %d):\n%s", pid, text)
        busy = report.busy_loop
        where = f" in {busy.top}" if busy is not None and busy.top else ""
        path = stacks.hang_dir() / (f"hang-{self.engine_id}-{pid}-"
                                    f"{time.strftime('%Y%m%dT%H%M%S')}.txt")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"engine {self.engine_id} (pid {pid}) {self._hung}{where}\n{text}\n")
            stacks.prune_hang_files(path.parent)    # the newest stacks.HANG_KEEP stay
        except OSError as e:
            log.error("could not write the stacks to %s: %s", path, e)
            return where
        return f"{where}; stacks: {path}"

    def _announce(self, record: dict[str, Any]) -> None:
        """The child is serving: keep its concrete endpoints for every later child and
        republish its record under this process's pid."""
        self._ever_ready = True
        if self.on_ready is not None:
            self.on_ready(record)
        self.endpoints = {n: record["endpoints"][n] for n in ENDPOINT_NAMES}
        if self._relay is not None and isinstance(record.get("metrics"), str):
            self._child_metrics = record["metrics"]
            record = {**record, "metrics": self._relay.url}
        log.info("engine ready (pid %d, restart %d): %s", record["pid"], self.restart_count,
                 " ".join(f"{n}={ep}" for n, ep in self.endpoints.items()))
        self._last_record = record
        self._publish_ready(record)

    def _publish_ready(self, record: dict[str, Any] | None) -> None:
        """The ready file: the child's record under this process's pid, with the restart
        count and the last restart's reason (rewritten at each restart)."""
        if self.ready_file is not None and record is not None:
            write_ready_file(self.ready_file, {
                **record, "pid": os.getpid(), "child_pid": record["pid"],
                "restart_count": self.restart_count, "restart_reason": self.restart_reason,
                "supervised": True})

    def _relay_stderr(self, pipe: IO[bytes], tail: collections.deque[str]) -> None:
        """Pass the child's stderr through, line by line, keeping the last lines."""
        out = self._stderr or sys.stderr
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace")
                tail.append(line.rstrip("\n"))
                with contextlib.suppress(OSError, ValueError):
                    out.write(line)
                    out.flush()

    # --- while no child runs ---------------------------------------------------------------

    def _wait_restarting(self, delay: float) -> None:
        """Publish ``restarting`` heartbeats for ``delay`` seconds (or until a stop), then
        release the telemetry endpoint for the next child."""
        deadline = time.monotonic() + delay
        with self._beacon() as beacon:
            next_beat = 0.0
            while self._stop_signal is None:
                now = time.monotonic()
                if now >= deadline:
                    break
                if beacon is not None and now >= next_beat:
                    beacon.send(RESTARTING, interval_s=self.heartbeat_interval_s,
                                restart_count=self.restart_count,
                                restart_reason=self.restart_reason)
                    # With every beat: a subscriber that reconnects late still hears the
                    # event (consoles list each restart count once).
                    beacon.send_alert(restart_event(self.restart_count, self.restart_reason,
                                                    back=False).payload())
                    next_beat = now + self.heartbeat_interval_s
                time.sleep(min(POLL_S, max(0.0, deadline - now)))

    @contextlib.contextmanager
    def _beacon(self) -> Iterator[HealthBeacon | None]:
        """A beacon on the telemetry endpoint, in a context of its own: terminating it when
        done guarantees the port is free again before the next child binds it. None when the
        endpoint is not known yet (a ``*`` port) or cannot be bound (logged)."""
        endpoint = self.endpoints["telemetry"]
        if not self.beacon or endpoint.endswith(":*"):
            yield None
            return
        ctx = zmq.Context()
        auth = self.curve.start_authenticator(ctx) if self.curve is not None else None
        beacon: HealthBeacon | None = None
        try:
            try:
                beacon = HealthBeacon(ctx, endpoint, self.engine_id, self.rank,
                                      sndhwm=self.sndhwm,
                                      secure=self.curve.secure if self.curve else None)
            except zmq.ZMQError as e:
                log.warning("cannot publish restarting heartbeats on %s: %s", endpoint, e)
            yield beacon
        finally:
            if beacon is not None:
                beacon.close()
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)

    # --- signals ----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, self._on_stop)
        if hasattr(signal, "SIGHUP"):
            previous[signal.SIGHUP] = signal.signal(
                signal.SIGHUP, lambda signum, _frame: self._signal_child(signum))
        return previous

    def _on_stop(self, signum: int, _frame: Any) -> None:
        self.stop(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """First SIGTERM/SIGINT: pass it on (the child drains), start nothing more. Another:
        kill the child now. Safe from a signal handler or another thread."""
        if self._stop_signal is None:
            self._stop_signal = signum
            self._signal_child(signum)
        else:
            self._signal_child(signal.SIGKILL)

    def _signal_child(self, sig: int) -> None:
        if self._child is not None:
            self._child.send_signal(sig)

    def _kill_child(self) -> None:
        if self._child is not None:
            self._child.kill()
