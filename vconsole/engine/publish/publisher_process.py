"""The publisher in a child process: the engine's side of it (`ChildLink`).

Why a process: a publisher thread in the engine process costs the busy loop more than its own
CPU — every time torch releases the GIL and the publisher thread takes it, the busy loop waits
to get it back (`vconsole bench telemetry` measured ~5% of the throughput for ~1% of CPU). In a
child process the publisher's loop, its encoding, the PUB socket, the gpu/host probes and
``/metrics`` take no GIL of the engine's. The busy loop keeps only the hand-off: each step is
appended to a list (O(1)); at most ``telemetry_hz`` times a second the snapshot and the steps
since the last one are packed (`handoff_wire`) and sent with one non-blocking send on a PUSH
socket over ``ipc://`` (ZeroMQ's I/O thread writes it, outside the GIL); the child answers
(``ready``, ``closed``) on a second one, read only at start and close. Rare hand-offs (config,
state, latency, dp, wave, errors) are a send each.

The child (`vconsole.engine.publish.publisher_child`, ``python -m``, no torch, no model) binds
the telemetry endpoint and ``/metrics`` where the engine process would have, and says so
(``ready``) before `start` returns; what it cannot bind fails `start` as an in-process bind would
(`zmq.ZMQError`, `OSError`).

Failure: a keeper thread waits on the child (in ``waitpid``, holding no GIL). A child that
dies is restarted after a backoff, on the endpoints already bound, with the engine's latest
config, state and step count; the new child raises a ``telemetry_error`` alert and counts it in
``health.telemetry_errors`` ("publisher process ... restarted"), and ``seq`` starts over as the
protocol says for a restarted publisher. The engine keeps serving throughout; hand-offs sent
while no child listens are dropped (steps counted in ``health.steps_dropped``).
The child exits when the engine does, even on ``kill -9``: it asks the kernel for SIGKILL on
its parent's death (``PR_SET_PDEATHSIG``, Linux) and checks its parent every poll.

Invariants: only the thread that calls the engine-thread methods (the busy loop) touches the
hand-off sockets; nothing here blocks it — a refused send (no child, high-water mark) is dropped
and counted.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from time import monotonic
from typing import Any

import zmq

from vconsole.engine.latency import LatencyBatch
from vconsole.engine.publish import handoff_wire as wire
from vconsole.engine.publish.bodies import KVFormat
from vconsole.engine.publish.queue_mirror import SyncSender
from vconsole.engine.publish.request_text import TextBook, TokenLists
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0        # a child's start (imports, binds) on a loaded machine
HANDOFF_HWM = 256             # messages queued for the child before sends are refused
MAX_PENDING_STEPS = 4096      # steps held between two snapshots before they go on their own
FLUSH_PERIODS = 2.0           # ...or snapshot periods since the last hand-off
LIVE_FILE = "live"            # the live counters' file, in the hand-off's folder
RESTART_BACKOFF_S = (0.5, 10.0)   # first wait after a death, doubling to the second
CHILD_MODULE = "vconsole.engine.publish.publisher_child"


@dataclass(frozen=True)
class ChildSpec:
    """What a publisher process starts from (pickled to its stdin). ``endpoint`` and
    ``metrics`` are where to bind (a restart gets the ones already bound); ``pid``,
    ``t0``/``t0_wall`` are the engine process's, so ``health`` names the engine, not the
    child; ``restarted``: why the previous child is gone (None on the first start)."""

    handoff: str               # the engine's PUSH (hand-offs), the child's PULL connects
    answers: str               # the engine's PULL, the child's PUSH connects
    parent_pid: int
    endpoint: str
    engine_id: str
    rank: int
    config: EngineConfig
    announced: tuple[int, dict[str, Any]]
    state: str
    steps_recorded: int
    engine_errors: int
    restart_count: int
    restart_reason: str | None
    kv_format: KVFormat | None
    t0: float
    t0_wall: float
    pid: int
    metrics: tuple[str, int] | None
    model_name: str
    text_decoded: bool
    restarted: str | None = None


class ChildStartError(RuntimeError):
    """The publisher process could not start (not a bind: those raise as binds do)."""


class ChildLink:
    """The engine thread's hand-off to a publisher process: the same engine-thread methods as
    `vconsole.engine.publish.inbox.Inbox`. ``detokenize``: request text is decoded here, when
    on (`TextBook`: only new or grown rows), and crosses as strings."""

    def __init__(self, ctx: zmq.Context, spec: ChildSpec,
                 detokenize: Any = None) -> None:
        self.config = spec.config
        self.announced = spec.announced
        self.steps_recorded = 0
        self.engine_errors = 0
        self.endpoint = spec.endpoint
        self.metrics_url: str | None = None
        self.restarts = 0
        self.sent: dict[str, int] = {}
        self.send_drops = 0
        self.handoff_drops = 0        # hand-offs refused (no child listening, or full)
        self._ctx = ctx
        self._spec = spec
        self._state = spec.state
        self._steps: list[StepStats] = []
        self._lost = 0
        self._next_snapshot = 0.0    # when the busy loop next builds one (`snapshot_due`)
        self._flush_at = 0.0          # steps not handed over by then go on their own
        self._text_book = TextBook(detokenize) if detokenize is not None else None
        self._dir = tempfile.mkdtemp(prefix="vconsole-pub-")   # 0700: only this user
        self._live = LiveCounters(os.path.join(self._dir, LIVE_FILE), create=True)
        self._live_n, self._live_t = self._live.cells()
        self._queue = SyncSender()           # how far the child's mirror of the queue is
        self._restarts_seen = 0
        self._sock: zmq.Socket | None = None     # PUSH: hand-offs to the child
        self._back: zmq.Socket | None = None     # PULL: the child's answers
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()       # the keeper and close: who owns the child
        self._closing = False
        self._ready_once = False            # a child was ready once: restarts from then on
        self._spawned = threading.Event()   # the keeper spawned the first child (or failed)
        self._spawn_error: BaseException | None = None
        self._keeper: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Bind the hand-off, spawn the child, wait for its ``ready`` (its binds done)."""
        sock = self._sock = self._ctx.socket(zmq.PUSH)
        back = self._back = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.SNDHWM, HANDOFF_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        back.setsockopt(zmq.LINGER, 0)
        try:
            handoff = f"ipc://{os.path.join(self._dir, 'handoff')}"
            answers = f"ipc://{os.path.join(self._dir, 'answers')}"
            sock.bind(handoff)
            back.bind(answers)
            self._spec = _replace(self._spec, handoff=handoff, answers=answers,
                                  parent_pid=os.getpid())
            # The keeper spawns every child: the kernel's parent-death signal follows the
            # thread that spawned, and the keeper lives as long as the link.
            self._keeper = threading.Thread(target=self._keep, name="telemetry-keeper",
                                            daemon=True)
            self._keeper.start()
            self._spawned.wait()
            if self._proc is None:
                raise ChildStartError(f"could not start the telemetry publisher process: "
                                      f"{self._spawn_error}")
            ready = self._await(self._proc, timeout)
        except BaseException:
            with self._lock:
                self._closing = True
            self._stop_child(0.0)
            if self._keeper is not None:
                self._keeper.join(5.0)
            self._cleanup()
            raise
        with self._lock:
            self.endpoint, self.metrics_url = ready["endpoint"], ready.get("metrics")
            self._spec = _replace(self._spec, endpoint=self.endpoint,
                                  metrics=ready.get("metrics_bind") or self._spec.metrics)
            self._ready_once = True

    def close(self, timeout: float = 5.0) -> None:
        """The steps not yet handed over go first; then the child stops (killed if it does not
        within ``timeout``) and reports what it sent (`sent`, `send_drops`)."""
        with self._lock:
            self._closing = True
        back = self._back
        if back is not None and self._proc is not None:
            self._flush_steps()
            self._send(wire.message_frames(wire.STOP))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not back.poll(50):
                    if self._proc.poll() is not None:    # gone: nobody will answer
                        break
                    continue
                with contextlib.suppress(zmq.ZMQError, pickle.UnpicklingError, EOFError):
                    kind, body = wire.decode(back.recv_multipart())
                    if kind == wire.CLOSED:       # (a restarted child's ready is skipped)
                        self.sent, self.send_drops = body["sent"], body["send_drops"]
                        break
        self._stop_child(timeout)
        if self._keeper is not None:
            self._keeper.join(timeout)
        self._cleanup()

    def is_alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # --- engine thread: the Inbox's methods ---------------------------------------------------

    def record_step(self, stats: StepStats) -> None:
        """O(1): the step joins the next hand-off (the next snapshot's, or on its own two periods
        after the last hand-off: the first step after a pause goes at once); the live counters
        say at once that it ran."""
        now = monotonic()
        n = self.steps_recorded = self.steps_recorded + 1
        self._live_t[0] = now          # (the time first: `LiveCounters`)
        self._live_n[0] = n
        steps = self._steps
        steps.append(stats)
        if now >= self._flush_at or len(steps) >= MAX_PENDING_STEPS:
            self._flush_steps()

    def snapshot_due(self) -> bool:
        # `inbox.SnapshotClock`, inlined: this runs after every step.
        now = monotonic()
        if now < self._next_snapshot:
            return False
        self._next_snapshot = now + 1.0 / self.config.telemetry_hz
        return True

    def submit_snapshot(self, sched: SchedulerStats, kv: KVStats, state: str,
                        num_steps: int, text: list[TokenLists] | None = None) -> None:
        self._state = state
        body = None
        if text is not None and self._text_book is not None:
            body = self._text_book.body(text)
        steps = self._take_steps()
        if self.restarts != self._restarts_seen:     # a new child holds no mirror
            self._restarts_seen = self.restarts
            self._queue.reset()
        back = self._back
        if back is not None and back.poll(0):        # the child's mirror lost step
            self._read_answers(back)
        self._queue.sent(self._send(wire.snapshot_frames(wire.Snapshot(
            sched, kv, state, num_steps, time.time(), body, steps), self._queue),
            len(steps.records)))

    def submit_latency(self, batch: LatencyBatch) -> None:
        self._call("submit_latency", batch)

    def submit_kv_residency(self, samples: list[ResidencySample]) -> None:
        self._call("submit_kv_residency", samples)

    def submit_dp(self, body: dict[str, Any]) -> None:
        self._call("submit_dp", body)

    def submit_wave(self, body: dict[str, Any]) -> None:
        self._call("submit_wave", body)

    def report_error(self, part: str, message: str) -> None:
        self.engine_errors += 1
        self._call("report_error", part, message)

    def set_state(self, state: str) -> None:
        self._state = state
        self._flush_steps()      # the steps that ran before it first
        self._call("set_state", state)

    def publish_config(self, version: int, values: dict[str, Any]) -> None:
        self.announced = (version, dict(values))
        self._call("publish_config", version, values)

    def update_config(self, config: EngineConfig) -> None:
        self.config = config
        self._call("update_config", config)

    # --- engine thread: sending ---------------------------------------------------------------

    def _take_steps(self) -> wire.Steps:
        steps, self._steps = self._steps, []
        self._flush_at = monotonic() + FLUSH_PERIODS / self.config.telemetry_hz
        return wire.Steps(wire.step_records(steps), self._lost)

    def _flush_steps(self) -> None:
        if self._steps:
            steps = self._take_steps()
            self._send(wire.steps_frames(steps), len(steps.records))

    def _read_answers(self, back: zmq.Socket) -> None:
        """The child's answers while it runs: a ``resync`` makes the next sync a full one."""
        while back.poll(0):
            with contextlib.suppress(zmq.ZMQError, pickle.UnpicklingError, EOFError):
                kind, _ = wire.decode(back.recv_multipart())
                if kind == wire.RESYNC:
                    self._queue.reset()

    def _call(self, method: str, *args: Any) -> None:
        self._send(wire.call_frames(method, *args))

    def _send(self, frames: list[Any], steps: int = 0) -> bool:
        """One non-blocking send; refused (no child listening, or the queue full): dropped,
        its ``steps`` counted as lost, False."""
        sock = self._sock
        try:
            if sock is None:
                raise zmq.Again()
            if len(frames) == 1:
                sock.send(frames[0], flags=zmq.NOBLOCK)
            else:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:     # zmq.Again, or a socket closed at shutdown
            self.handoff_drops += 1
            self._lost += steps
            return False

    # --- the child ------------------------------------------------------------------------------

    def _spawn(self, spec: ChildSpec) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                                close_fds=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(pickle.dumps(spec, protocol=5))
            proc.stdin.close()
        except OSError:          # it died at once: its exit says why
            pass
        self._proc = proc
        return proc

    def _await(self, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
        """The child's ``ready``; its bind failure raised as a bind's; ChildStartError else."""
        assert self._back is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._back.poll(100):
                kind, body = wire.decode(self._back.recv_multipart())
                if kind == wire.READY:
                    return dict(body)
                if kind == wire.FAILED:
                    raise _start_error(body)
            elif proc.poll() is not None:
                raise ChildStartError(f"the telemetry publisher process exited with code "
                                      f"{proc.returncode} before it was ready")
        raise ChildStartError(f"the telemetry publisher process was not ready within "
                              f"{timeout:g} s")

    def _keep(self) -> None:
        """Keeper thread: spawn the child, wait on it, restart it when it dies after it was
        ready once (not when closing)."""
        try:
            self._spawn(self._spec)
        except BaseException as e:
            self._spawn_error = e
            return
        finally:
            self._spawned.set()
        backoff = RESTART_BACKOFF_S[0]
        while True:
            proc = self._proc
            assert proc is not None
            started = time.monotonic()
            code = proc.wait()
            with self._lock:
                if self._closing or not self._ready_once:
                    return
            if time.monotonic() - started > 60.0:     # it had been serving: start over
                backoff = RESTART_BACKOFF_S[0]
            why = _exit_reason(code)
            log.error("the telemetry publisher process %d died (%s); restarting it in %g s "
                      "(the engine keeps serving)", proc.pid, why, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
            with self._lock:
                if self._closing:
                    return
                self.restarts += 1
                spec = _replace(self._spec, config=self.config, announced=self.announced,
                                state=self._state, steps_recorded=self.steps_recorded,
                                engine_errors=self.engine_errors,
                                restarted=f"publisher process {why}; restarted "
                                          f"({self.restarts} so far)")
                try:
                    self._spawn(spec)
                except OSError:
                    log.exception("could not restart the telemetry publisher process")
                    return

    def _stop_child(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the telemetry publisher process did not stop within %g s; killing it",
                        timeout)
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)

    def _cleanup(self) -> None:
        for sock in (self._sock, self._back):
            if sock is not None:
                sock.close(0)
        self._sock = self._back = None
        self._live.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class LiveCounters:
    """The engine's step count and the monotonic time of its last step, in 16 bytes of a
    file both processes map: written by the busy loop at every step (two stores, no call
    into the child), read by the publisher process for each ``health`` — so ``steps`` and
    ``last_step_age_s`` are as current as in-process, and a stuck step shows at once. A reader
    may see the count of one step with the time of the one before (harmless)."""

    SIZE = 16

    def __init__(self, path: str, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._map = mmap.mmap(fd, self.SIZE, access=mmap.ACCESS_WRITE if create
                                  else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        view = memoryview(self._map)
        self._n, self._t = view[:8].cast("q"), view[8:].cast("d")
        self._view = view

    def cells(self) -> tuple[memoryview[int], memoryview[float]]:
        """The count's and the time's cells: the writer stores into them itself (the time
        first), at every step."""
        return self._n, self._t

    def read(self) -> tuple[int, float | None]:
        """(steps, when the last one ended; None before the first)."""
        n = self._n[0]
        return n, (self._t[0] if n else None)

    def close(self) -> None:
        self._n.release()
        self._t.release()
        self._view.release()
        self._map.close()


def _replace(spec: ChildSpec, **values: Any) -> ChildSpec:
    from dataclasses import replace

    return replace(spec, **values)


def _exit_reason(code: int) -> str:
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _start_error(body: dict[str, Any]) -> BaseException:
    """The child's failure to bind, raised as the bind itself would have raised."""
    message = body.get("message", "unknown")
    if body.get("kind") == "zmq":
        return zmq.ZMQError(body.get("errno") or zmq.EINVAL, message)
    if body.get("kind") == "os":
        return OSError(body.get("errno") or 0, message)
    return ChildStartError(f"the telemetry publisher process failed to start: {message}")
