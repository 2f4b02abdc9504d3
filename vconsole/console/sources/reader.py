"""`ReaderSource`: what every kind of `vconsole.console.sources.source.Source` shares — a
reader thread, the recording, and the batched folding of messages into `ConsoleState`.

Why a thread (Memray's live TUI does the same): a socket read, a file read or an HTTP scrape
must never run on Textual's event loop. The thread only decodes and folds messages into
`ConsoleState` under its lock, then calls ``on_data`` when what it folded in includes a
snapshot (`WAKE_TOPICS`: the ``sched`` message every 10 Hz snapshot has; its ``step`` and
``kv`` come with it): the app wakes up and refreshes, at most ~10 times a second, so the screen
follows the stream promptly at a bounded rate whatever the message rate. Other messages wake
nothing: they show with the next snapshot or on the app's slow timer, and never spend the
refresh a snapshot right behind them needs.

Conflation: of a burst of messages, a ``sched`` snapshot that a newer one of the same engine
rank follows in the burst is not decoded at all (`vconsole.telemetry.schema.peek` reads its
envelope): a console that fell behind catches up with one 10k-row decode instead of one per
queued snapshot. Its ``seq`` is still noted (`ConsoleState.note_skipped`), so it is not counted
as lost, and the recording still gets every message.

Every source can tee the raw frames it reads into a `vconsole.telemetry.record.Recorder`
(start/stop from the console), and owns a clock (``now``): wall time live, a virtual clock in a
replay (so ages and staleness follow the recording, not the machine running it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.console.sources.source import ActionError, Source, SourceAction
from vconsole.console.state import ConsoleState
from vconsole.telemetry.schema import SchemaVersionError, peek

CONFLATE = frozenset({"sched"})  # state topics whose older snapshots in a burst are skipped
WAKE_TOPICS = frozenset({"sched"})   # a new snapshot: data to show now
_WAKE_BYTES = frozenset(t.encode("ascii") for t in WAKE_TOPICS)


class ReaderSource:
    """The reader thread, the recording and the batched folding every `Source` kind shares
    (subclasses: ``_run``, and ``describe``, ``live``, ``readonly_reason``, ``actions`` where
    theirs differ)."""

    kind = "source"         # names the reader thread
    live = True
    readonly_reason = ""    # why the engine it watches cannot be steered (shown by the console)
    actions: tuple[SourceAction, ...] = ()

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
        self.engine_keys: set[str] = set()                # engines it fed (its thread writes)
        self.engine_as: str | None = None                 # a fleet target's name for them

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
                state.note_skipped(self.engine_as or head[1], head[2], head[0], head[3])
                self.conflated += 1
            else:
                self._fold(state, frames, ts)
        self._notify(batch)

    def _fold(self, state: ConsoleState, frames: Sequence[Any], ts: float) -> None:
        """One message into the state, its engine's key noted as one this source feeds."""
        msg = state.ingest(frames, ts, self.engine_as)
        if msg is not None:
            self.engine_keys.add(f"{msg.engine}/{msg.rank}")

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

    def record_into(self, recorder: Any) -> None:
        """Write what it reads into ``recorder`` (shared by a fleet's sources, so thread-safe:
        `vconsole.console.sources.fleet.recording.SharedRecorder`)."""
        with self._rec_lock:
            self._recorder = recorder
            self.recording_path = str(getattr(recorder, "path", "")) or None
            self.recorded = 0

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
        if self.engine_as is not None:      # a fleet's: kept under the target's name
            from vconsole.console.sources.fleet.recording import renamed

            frames = renamed(frames, self.engine_as)
        with self._rec_lock:
            if self._recorder is not None:
                self._recorder.write(frames, ts)
                self.recorded += 1


if TYPE_CHECKING:   # the type checker verifies the shared part is a whole Source
    _source: type[Source] = ReaderSource
