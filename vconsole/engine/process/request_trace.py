"""TraceBook: the engine's request trace, kept in memory for the last minutes and, on demand,
written to a file (the format: `vconsole.telemetry.request_trace`).

Always on: the last `TRACE_WINDOW_S` seconds (at most `MAX_REQUESTS` finished requests and
`MAX_STEPS` steps) stay in memory, for a console's what-if (``get_trace`` over the control
channel, `lines`). With the hot ``request_trace`` key set, the same records also go to that
file as they come (`use_file`).

Who does what:

- **busy loop**: `add_step` after every step, with the step's `StepStats` and the `Request`
  objects that finished in it (`EngineCore.last_finished`): one append to a deque, nothing
  else — no hashing, no JSON, no I/O. `config_changed` after a change applied, `use_file`
  after ``request_trace`` changed (the file is opened by `open_trace_file` before the change
  applies, so a path that cannot be written refuses the change with the reason).
- **the trace thread** (``request-trace``, `start` / `close`): a few times a second it takes
  what the busy loop handed over, in order, and turns it into lines: a finished request into
  its record and line, its prompt into block hashes keyed for this book (the `Request` is then
  let go), a `StepStats` into a `StepRecord` and, once its period is known, its line. It forgets what left the window and, while a file is open,
  appends the new lines to it; it writes the file's header when it opens it and closes it
  when the key changes or at `close`.
- **the control thread**: `lines(window_s)` for ``get_trace``: the request lines and step
  records of the last ``window_s`` seconds, copied under the lock; outside it, the steps are
  formatted (`step_line`, a few microseconds each: under a second for a full window) and all
  joined (never on the busy loop).

A step's ``period`` is its start to the next step's start when the engine went straight on
(requests were left after it and the next step scheduled tokens); it is set when that next
step arrives. Steps that scheduled no token (every waiting request blocked, or only aborts
to report) are not records: the engine waited after them (`STALL_WAIT_S`), so the step before
one keeps ``period`` None.

Times are seconds since the book's ``t0`` (``time.monotonic``, the clock of the requests'
``arrival_time`` and token times; ``started_unix`` the wall clock then). A request finished
by a stop rule finishes at its last token; one aborted, timed out or failed at the end of the
step that reported it. Each carries the config version in force in that step.

Invariants: the busy loop's calls never block on I/O or on the trace thread; the trace thread
(or the control thread, for a snapshot) turns handed-over items into records in the order
they were handed over, under one lock; the file only ever receives whole lines, written at
once on an unbuffered file, so a reader sees half a line only if the engine was killed
mid-write; its first line is the header, holding the config in force when it was opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from io import FileIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.telemetry.request_trace import (
    RequestRecord,
    StepRecord,
    TraceHeader,
    config_line,
    header_line,
    prompt_block_hashes,
    request_line,
    request_record,
    step_line,
)

if TYPE_CHECKING:
    from vconsole.engine.request import Request
    from vconsole.shared.config import EngineConfig
    from vconsole.shared.stats import StepStats

log = logging.getLogger("vconsole.engine")

TRACE_WINDOW_S = 300.0      # kept in memory, always
MAX_REQUESTS = 50_000       # ... and at most this many finished requests
MAX_STEPS = 200_000         # ... and steps
POLL_S = 0.25               # the trace thread's pace
CLOSE_WAIT_S = 5.0          # at shutdown, how long the trace thread gets to write the rest
KEY = "request_trace"       # the config key

_STEP, _CONFIG, _FILE, _STOP = "step", "config", "file", "stop"
_STOP_RULES = ("length", "stop")


def trace_file_path(path: str, config: EngineConfig) -> str:
    """The file this engine writes for ``request_trace = path``: the path itself, except for a
    rank of a data-parallel group, which writes ``<stem>.rank<R><suffix>`` beside it (the
    ranks share the key and must not share the file)."""
    if config.data_parallel_size <= 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{config.dp_rank}{p.suffix}"))


def open_trace_file(path: str) -> FileIO:
    """``path`` opened for the trace (truncated, unbuffered). Raises OSError saying why not."""
    try:
        return FileIO(path, "w")
    except OSError as e:
        raise OSError(f"cannot write the request trace to {path}: "
                      f"{e.strerror or e}") from None


class TraceBook:
    """See the module docstring. ``header``: the model's fields (config and version are
    filled in per file and snapshot); ``config`` / ``config_version``: those in force now."""

    def __init__(self, header: TraceHeader, config: EngineConfig, config_version: int, *,
                 window_s: float = TRACE_WINDOW_S, max_requests: int = MAX_REQUESTS,
                 max_steps: int = MAX_STEPS, poll_s: float = POLL_S) -> None:
        self.t0 = time.monotonic()
        self.header = dataclasses.replace(header, started_unix=time.time())
        self.block_size = header.block_size
        self.window_s = window_s
        self._poll_s = poll_s
        # Busy loop -> trace thread, in order; deque's append and popleft are thread-safe.
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._max_inbox = max_requests + max_steps
        self.dropped = 0                        # items the busy loop could not hand over
        # The trace thread's (and a snapshot's) state, under _lock.
        self._lock = threading.Lock()
        # Finished lines, (time, JSON line), in the order they were made: a snapshot only
        # copies and joins them (`lines`), so ``get_trace`` holds the lock for a copy.
        self._requests: deque[tuple[float, str]] = deque(maxlen=max_requests)
        # Steps stay records (a step is a few microseconds to serialize, and there are many:
        # made into lines only for a file or a snapshot, never for nothing).
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        # The prompts' block hashes are keyed per book: equal within this trace, which is all a
        # replay needs, and no use to anyone testing a guessed prompt against them.
        self._hash_key = os.urandom(16)
        self._configs: list[tuple[float, int, dict[str, Any]]] = [
            (0.0, config_version, config.to_dict())]
        self._open_step: StepRecord | None = None   # its period waits for the next step
        self._open_step_file: FileIO | None = None  # the file it goes to then
        self._file: FileIO | None = None
        self._file_path: str | None = None
        self._failures = 0
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="request-trace", daemon=True)

    # --- busy loop ----------------------------------------------------------------------------

    def add_step(self, step: StepStats, finished: Sequence[Request], config_version: int) -> None:
        """One step and the requests that finished in it (a list the core replaces, never
        mutates). O(1)."""
        if len(self._inbox) < self._max_inbox:
            self._inbox.append((_STEP, step, finished, config_version))
        else:
            self.dropped += 1

    def config_changed(self, config_version: int, config: EngineConfig) -> None:
        self._inbox.append((_CONFIG, time.monotonic(), config_version, config))

    def use_file(self, handle: FileIO | None, path: str | None) -> None:
        """From now on write the trace to ``handle`` (opened by `open_trace_file`; None: no
        file). The file written so far, if any, is closed."""
        self._inbox.append((_FILE, handle, path))
        self._wake.set()

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Write what is left and close the file (the engine is stopping)."""
        self._inbox.append((_STOP,))
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(CLOSE_WAIT_S)
        else:                                   # never started: do its last pass here
            self._drain()

    # --- any thread ---------------------------------------------------------------------------

    @property
    def file_path(self) -> str | None:
        return self._file_path

    def lines(self, window_s: float | None = None) -> str:
        """The trace of the last ``window_s`` seconds (default and at most the whole window)
        as JSON lines: the header (the config in force at the window's start), the config
        changes since, then request and step lines in time order. The lock is held only to
        take in what is pending and copy the finished lines; filtering, sorting and joining
        happen after."""
        with self._lock:
            self._drain_locked()
            span = self.window_s if window_s is None else min(max(window_s, 0.0), self.window_s)
            cutoff = time.monotonic() - self.t0 - span
            configs = list(self._configs)
            requests, steps = list(self._requests), list(self._steps)
            if self._open_step is not None:          # its period is not known yet
                steps.append(dataclasses.replace(self._open_step))
            lost = self.dropped + self._failures
        head = configs[0]
        later = []
        for entry in configs:
            if entry[0] <= cutoff:
                head = entry
            else:
                later.append(entry)
        timed = [(t, 0, line) for t, line in requests if t >= cutoff]
        timed += [(st.t, 1, step_line(st)) for st in steps if st.t >= cutoff]
        timed.sort(key=lambda x: (x[0], x[1]))
        header = dataclasses.replace(self.header, config_version=head[1], config=head[2],
                                     records_lost=lost)
        out = [header_line(header)]
        out += [config_line(t, v, c) for t, v, c in later if v != head[1]]
        out += [line for _, _, line in timed]
        return "".join(out)

    # --- the trace thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._poll_s)
            self._wake.clear()
            try:
                if self._drain():
                    return
            except Exception:       # never let the trace thread die: the next pass goes on
                self._failed()

    def _failed(self) -> None:
        self._failures += 1
        if self._failures == 1:
            log.exception("request trace: a record could not be made (it is left out; later "
                          "failures are only counted)")

    def _drain(self) -> bool:
        """Turn everything handed over into records; True once told to stop."""
        with self._lock:
            return self._drain_locked()

    def _drain_locked(self) -> bool:
        lines: list[tuple[float, str]] = []
        stop = False
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            tag = item[0]
            try:
                if tag is _STEP:
                    self._take_step(item[1], item[2], item[3], lines)
                    if item[2]:
                        time.sleep(0)   # hashing is Python work: let the busy loop have the GIL
                elif tag is _CONFIG:
                    t, version, config = item[1] - self.t0, item[2], item[3].to_dict()
                    self._configs.append((t, version, config))
                    if self._file is not None:
                        lines.append((t, config_line(t, version, config)))
                elif tag is _FILE:
                    self._switch_file(item[1], item[2], lines)
                else:
                    self._switch_file(None, None, lines)
                    stop = True
            except Exception:
                self._failed()
        self._write(lines)
        self._forget(time.monotonic() - self.t0 - self.window_s)
        return stop

    def _take_step(self, stats: StepStats, finished: Sequence[Request], version: int,
                   lines: list[tuple[float, str]]) -> None:
        end = (stats.start_ns + stats.total_ns) / 1e9
        for req in finished:
            record = self._keep(req, end, version)
            entry = (record.finish, request_line(record))
            self._requests.append(entry)
            if self._file is not None:
                lines.append(entry)
        if stats.num_prefill_tokens + stats.num_decode_tokens == 0:
            self._settle(None, lines)       # the engine waited: no period for the one before
            return
        rec = StepRecord(
            t=stats.start_ns / 1e9 - self.t0, dur=stats.total_ns / 1e9,
            execute=stats.execute_ns / 1e9, prefill=stats.num_prefill_tokens,
            decode=stats.num_decode_tokens, reqs=stats.num_reqs, running=stats.num_running,
            waiting=stats.num_waiting, context=stats.num_context_tokens,
            prefill_attn=stats.prefill_attention, new_reqs=stats.num_new_reqs,
            preempted=stats.num_preempted, finished=stats.num_finished,
            kv_used=stats.kv_used_blocks, native=stats.native)
        self._settle(rec.t, lines)
        if stats.num_running + stats.num_waiting > 0:
            self._open_step, self._open_step_file = rec, self._file
        else:
            self._finish_step(rec, self._file, lines)

    def _settle(self, next_t: float | None, lines: list[tuple[float, str]]) -> None:
        """The open step's period is known now: ``next_t`` - its start (None: no period)."""
        rec = self._open_step
        if rec is None:
            return
        if next_t is not None:
            rec.period = next_t - rec.t
        self._finish_step(rec, self._open_step_file, lines)
        self._open_step = self._open_step_file = None

    def _finish_step(self, rec: StepRecord, file: FileIO | None,
                     lines: list[tuple[float, str]]) -> None:
        self._steps.append(rec)
        if file is not None and file is self._file:
            lines.append((rec.t, step_line(rec)))

    def _keep(self, req: Request, step_end: float, version: int) -> RequestRecord:
        last = req.last_token_time
        finish = (last if last is not None and str(req.finish_reason) in _STOP_RULES
                  else step_end)
        hashes = prompt_block_hashes(req.prompt_token_ids, self.block_size, key=self._hash_key)
        return request_record(req, t0=self.t0, finish=finish, config_version=version,
                              block_hashes=hashes)

    def _switch_file(self, handle: FileIO | None, path: str | None,
                     lines: list[tuple[float, str]]) -> None:
        old = self._file
        if old is not None:
            if self._open_step_file is old and self._open_step is not None:
                lines.append((self._open_step.t, step_line(self._open_step)))   # period unknown
                self._open_step_file = None
            self._write(lines)
            try:
                old.close()
            except OSError as e:
                log.error("request trace: closing %s failed: %s", self._file_path, e)
            log.info("request trace: %s closed", self._file_path)
        self._file, self._file_path = handle, path
        if handle is not None:
            t, version, config = self._configs[-1]
            header = dataclasses.replace(self.header, config_version=version, config=config)
            lines.append((float("-inf"), header_line(header)))
            self._write(lines)
            log.info("request trace: writing to %s", path)

    def _write(self, lines: list[tuple[float, str]]) -> None:
        """Append ``lines`` (in time order) to the file in one write, and empty the list."""
        if not lines:
            return
        fh = self._file
        lines.sort(key=lambda x: x[0])
        data = "".join(line for _, line in lines).encode("utf-8")
        lines.clear()
        if fh is None:
            return
        try:
            view = memoryview(data)
            while view:
                n = fh.write(view)
                view = view[n or 0:]
        except OSError as e:
            log.error("request trace: writing %s failed (%s): the file is closed; set "
                      "request_trace again to start a new one", self._file_path, e)
            self._file = None
            self._open_step_file = None
            with contextlib.suppress(OSError):
                fh.close()

    def _forget(self, cutoff: float) -> None:
        """Drop what finished or started before ``cutoff``; the config in force then stays."""
        reqs, steps = self._requests, self._steps
        while reqs and reqs[0][0] < cutoff:
            reqs.popleft()
        while steps and steps[0].t < cutoff:
            steps.popleft()
        configs = self._configs
        while len(configs) > 1 and configs[1][0] <= cutoff:
            configs.pop(0)


def trace_header(config: EngineConfig, model: dict[str, Any]) -> TraceHeader:
    """The trace header's model fields: ``model`` is `EngineCore.model_info()`."""
    return TraceHeader(
        model=config.model, block_size=config.block_size,
        num_kv_blocks=model.get("num_kv_blocks"), vocab_size=model.get("vocab_size"),
        max_model_len=model.get("max_model_len"), kv_cache_dtype=model.get("kv_cache_dtype"),
        kv_bytes_per_token=model.get("kv_bytes_per_token"),
        kv_bytes_per_token_by_dtype=dict(model.get("kv_bytes_per_token_by_dtype") or {}),
        kv_block_bytes_by_dtype={k: list(v) for k, v in
                                 (model.get("kv_block_bytes_by_dtype") or {}).items()},
        kv_pool_bytes=model.get("kv_pool_bytes"), engine_id=config.engine_id,
        native_decode_rows=int(model.get("native_decode_rows") or 0))
