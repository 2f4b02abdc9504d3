"""Where our engine's telemetry comes from: a live ZeroMQ SUB socket (`ZmqSource`) or a
recorded file (`ReplaySource`), each a `vconsole.console.sources.source.Source` read in a thread
(`vconsole.console.sources.reader.ReaderSource`: waking the app, conflation, recording).

Live, the reader drains a burst of queued messages before folding it in (a publisher sends
``step``, ``sched`` and ``kv`` back to back: `COALESCE_MS`), so the burst is shown as one and
its older ``sched`` snapshots are conflated away. A replay owns a virtual clock, so ages and
staleness follow the recording, not the machine running it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.console.format import duration
from vconsole.console.sources.reader import ReaderSource
from vconsole.console.state import ConsoleState
from vconsole.security.curve import ClientCurve

if TYPE_CHECKING:
    from vconsole.console.sources.source import Source

POLL_MS = 100
MAX_BATCH = 2000  # messages drained per wake-up before checking for stop
# A publisher sends step, sched and kv back to back: after the first message of a burst, wait
# this long for more (at most COALESCE_MAX_MS in all), so the burst is folded in and shown as
# one (a refresh on ``step`` alone would hold the ``sched`` right behind it a refresh period).
COALESCE_MS = 2
COALESCE_MAX_MS = 10


class ZmqSource(ReaderSource):
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


class ReplaySource(ReaderSource):
    """A recorded file played back at ``speed`` (0 or less: everything at once, before the UI
    starts — what the tests and snapshots use, so the first frame is already the final one).

    The virtual clock starts at the first record's receive time and advances with wall time x
    speed; after the last record it stops there, so a finished replay does not go stale."""

    kind = "replay"
    live = False

    def __init__(self, path: str | Path, speed: float = 1.0,
                 records: Callable[[], Iterator[tuple[float, Sequence[Any]]]] | None = None,
                 *, readonly: bool = True) -> None:
        super().__init__()
        self.readonly_reason = "replay" if readonly else ""  # tests steer a console from a file
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
                self._fold(state, frames, ts)
                if self.speed > 0:
                    self._notify(((ts, frames),))
        finally:
            self.finished = True
            with state.lock:
                state.generation += 1


if TYPE_CHECKING:   # the type checker verifies both are whole Sources
    _sources: tuple[type[Source], ...] = (ZmqSource, ReplaySource)
