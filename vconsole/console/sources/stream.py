"""Where our engine's telemetry comes from: a live ZeroMQ SUB socket or a recorded file, read
in a thread; and `Source`, the base of every console source (a vLLM server's too:
`vconsole.console.sources.vllm`).

Why a thread (Memray's live TUI does the same): a socket read or a file read must never run on
Textual's event loop. The thread only decodes and folds messages into `ConsoleState` under its
lock, then calls ``on_data`` when what it folded in includes a snapshot (`WAKE_TOPICS`: the
``sched`` message every 10 Hz snapshot has; its ``step`` and ``kv`` come with it): the app wakes
up and refreshes, at most ~10 times a second, so the screen follows the stream promptly at a
bounded rate whatever the message rate. Other messages wake nothing: they show with the next
snapshot or on the app's slow timer, and never spend the refresh a snapshot right behind them
needs.

Conflation (live): of a burst of queued messages, a ``sched`` snapshot that a newer one of the
same engine rank follows in the burst is not decoded at all (`vconsole.telemetry.schema.peek`
reads its envelope): a console that fell behind catches up with one 10k-row decode instead of
one per queued snapshot. Its ``seq`` is still noted (`ConsoleState.note_skipped`), so it is not
counted as lost, and the recording still gets every message.

Both sources can tee the raw frames they read into a `vconsole.telemetry.record.Recorder` (start/stop
from the console), and both own the clock the state uses: wall time live, a virtual clock in a
replay (so ages and staleness follow the recording, not the machine running it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from vconsole.console.format import duration
from vconsole.console.sources.vllm_actions import ActionError
from vconsole.console.state import ConsoleState
from vconsole.security.curve import ClientCurve
from vconsole.telemetry.schema import SchemaVersionError, peek

POLL_MS = 100
MAX_BATCH = 2000  # messages drained per wake-up before checking for stop
# A publisher sends step, sched and kv back to back: after the first message of a burst, wait
# this long for more (at most COALESCE_MAX_MS in all), so the burst is folded in and shown as
# one (a refresh on ``step`` alone would hold the ``sched`` right behind it a refresh period).
COALESCE_MS = 2
COALESCE_MAX_MS = 10
CONFLATE = frozenset({"sched"})  # state topics whose older snapshots in a burst are skipped
WAKE_TOPICS = frozenset({"sched"})   # a new snapshot: data to show now
_WAKE_BYTES = frozenset(t.encode("ascii") for t in WAKE_TOPICS)


class Source:
    """Base: recording and lifecycle shared by the live and replay sources."""

    kind = "source"
    readonly = False
    readonly_reason = ""   # why a read-only source cannot steer (shown by the console)
    actions: tuple[Any, ...] = ()   # what the source's server may be asked to do (a vLLM's)

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rec_lock = threading.Lock()
        self._recorder: Any = None
        self.recording_path: str | None = None
        self.recorded = 0
        self.error: str | None = None
        self.finished = False
        self.on_data: Callable[[], None] | None = None   # called after each batch is folded in
        self.conflated = 0                                # snapshots skipped (see the docstring)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, state: ConsoleState) -> None:
        state.clock = self.now
        self._thread = threading.Thread(target=self._guarded_run, args=(state,),
                                        name=f"telemetry-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.stop_recording()

    def now(self) -> float:
        return time.time()

    def describe(self) -> str:
        return self.kind

    def run_action(self, key: str) -> str:
        """Ask the source's server to do one of its ``actions`` (blocking); the answer in a line,
        or `ActionError`. Our engine's stream has none: it is steered over the control socket."""
        raise ActionError(f"{self.kind}: this source has no actions")

    def _guarded_run(self, state: ConsoleState) -> None:
        try:
            self._run(state)
        except SchemaVersionError as e:
            state.note_schema_error(str(e))
        except Exception as e:  # shown in the console instead of killing the thread silently
            self.error = f"{type(e).__name__}: {e}"
            state.note_error(f"telemetry reader stopped: {self.error}")

    def _run(self, state: ConsoleState) -> None:
        raise NotImplementedError

    def _notify(self, batch: Sequence[tuple[float, Sequence[Any]]]) -> None:
        if self.on_data is not None and any(
                len(frames) and bytes(frames[0]) in _WAKE_BYTES for _, frames in batch):
            self.on_data()

    def _ingest_batch(self, state: ConsoleState, batch: list[tuple[float, Sequence[Any]]]) -> None:
        """Fold in a burst of messages, decoding only the newest ``CONFLATE`` snapshot of each
        engine rank (older ones only have their ``seq`` noted)."""
        heads = [peek(frames) if len(batch) > 1 else None for _, frames in batch]
        newest: dict[tuple[str, str, int], int] = {}
        for i, head in enumerate(heads):
            if head is not None and head[0] in CONFLATE:
                newest[head[:3]] = i
        for i, (ts, frames) in enumerate(batch):
            head = heads[i]
            if head is not None and head[0] in CONFLATE and newest[head[:3]] != i:
                state.note_skipped(head[1], head[2], head[0], head[3])
                self.conflated += 1
            else:
                state.ingest(frames, ts)
        self._notify(batch)

    # --- recording ---------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self._recorder is not None

    def start_recording(self, path: str | Path) -> str:
        from vconsole.telemetry.record import Recorder

        with self._rec_lock:
            if self._recorder is not None:
                return str(self.recording_path)
            self._recorder = Recorder(str(path))
            self.recording_path = str(path)
            self.recorded = 0
        return str(path)

    def toggle_recording(self, record_dir: Path) -> tuple[str, bool]:
        """``R``: stop the recording, or start one in ``record_dir`` named by the time; what to
        tell the operator, and False when it could not start."""
        if self.recording:
            path, n = self.stop_recording()
            return f"recording stopped: {n:,} messages in {path}", True
        target = record_dir / f"vconsole-{datetime.now().strftime('%Y%m%d-%H%M%S')}.vrec"
        try:
            record_dir.mkdir(parents=True, exist_ok=True)
            self.start_recording(target)
        except OSError as e:
            return f"cannot record to {target}: {e}", False
        return f"recording the raw stream to {target} (R stops)", True

    def stop_recording(self) -> tuple[str | None, int]:
        with self._rec_lock:
            rec, self._recorder = self._recorder, None
            path = self.recording_path
            if rec is not None:
                rec.close()
        return path, self.recorded

    def _tee(self, ts: float, frames: Sequence[Any]) -> None:
        if self._recorder is None:
            return
        with self._rec_lock:
            if self._recorder is not None:
                self._recorder.write(frames, ts)
                self.recorded += 1


class ZmqSource(Source):
    """Live: one SUB socket connected to every endpoint (one per engine rank).

    ZeroMQ reconnects a SUB by itself when a publisher goes away and comes back, so an engine
    restart needs nothing here; the state notices the heartbeat gap and the seq reset.
    ``curve``: this client's keys, for engines started with CURVE keys."""

    kind = "live"

    def __init__(self, endpoints: Sequence[str], hwm: int = 10_000,
                 curve: ClientCurve | None = None) -> None:
        super().__init__()
        self.endpoints = list(endpoints)
        self.hwm = hwm
        self.curve = curve

    def describe(self) -> str:
        return " ".join(self.endpoints)

    def _run(self, state: ConsoleState) -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if self.curve is not None:
                self.curve.apply(sock)
            for ep in self.endpoints:
                sock.connect(ep)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                batch: list[tuple[float, Sequence[Any]]] = []
                until = time.monotonic() + COALESCE_MAX_MS / 1000
                while True:
                    while len(batch) < MAX_BATCH:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        ts = time.time()
                        bufs = [f.buffer for f in frames]
                        self._tee(ts, bufs)
                        batch.append((ts, bufs))
                    if (len(batch) >= MAX_BATCH or time.monotonic() >= until
                            or not poller.poll(COALESCE_MS)):
                        break
                self._ingest_batch(state, batch)
        finally:
            sock.close(0)
            ctx.term()


class ReplaySource(Source):
    """A recorded file played back at ``speed`` (0 or less: everything at once, before the UI
    starts — what the tests and snapshots use, so the first frame is already the final one).

    The virtual clock starts at the first record's receive time and advances with wall time x
    speed; after the last record it stops there, so a finished replay does not go stale."""

    kind = "replay"
    readonly = True
    readonly_reason = "replay"

    def __init__(self, path: str | Path, speed: float = 1.0,
                 records: Callable[[], Iterator[tuple[float, Sequence[Any]]]] | None = None,
                 *, readonly: bool = True) -> None:
        super().__init__()
        self.readonly = readonly  # tests drive a writable console from a file
        self.path = str(path)
        self.speed = speed
        self._records = records
        self._t0: float | None = None
        self._wall0 = 0.0
        self._last_ts: float | None = None
        self.count = 0

    def _iter(self) -> Iterator[tuple[float, Sequence[Any]]]:
        if self._records is not None:
            return self._records()
        from vconsole.telemetry.record import read_records

        return iter(read_records(self.path))

    def now(self) -> float:
        if self._t0 is None:
            return self._last_ts or 0.0
        if self.finished or self.speed <= 0:
            return self._last_ts if self._last_ts is not None else self._t0
        return self._t0 + (time.monotonic() - self._wall0) * self.speed

    @property
    def elapsed(self) -> float:
        return 0.0 if self._t0 is None else max(0.0, self.now() - self._t0)

    def describe(self) -> str:
        name = Path(self.path).name
        if self.finished:
            return f"■ END {name} {duration(self.elapsed)}"
        return f"▶ {name} ×{self.speed:g} {duration(self.elapsed)}"

    def start(self, state: ConsoleState) -> None:
        if self.speed > 0:
            super().start(state)
            return
        state.clock = self.now
        self._guarded_run(state)

    def _run(self, state: ConsoleState) -> None:
        try:
            for ts, frames in self._iter():
                if self._t0 is None:
                    self._t0, self._wall0 = ts, time.monotonic()
                if self.speed > 0:
                    due = self._wall0 + (ts - self._t0) / self.speed
                    delay = due - time.monotonic()
                    if delay > 0 and self._stop.wait(delay):
                        return
                elif self._stop.is_set():
                    return
                self._last_ts = ts
                self.count += 1
                self._tee(ts, frames)
                state.ingest(frames, ts)
                if self.speed > 0:
                    self._notify(((ts, frames),))
        finally:
            self.finished = True
            with state.lock:
                state.generation += 1
