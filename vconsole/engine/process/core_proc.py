"""EngineCoreProc: the EngineCore as a live process — I/O threads and queues around the core.

Threads and what each one owns (a ZeroMQ socket is bound in the constructor,
`vconsole.engine.process.sockets`, so a busy port fails fast, and from then on is touched only
by its one thread, which also closes it):

- **busy loop** (the main thread): the `EngineCore` itself. It drains the input queue
  (`loop_inputs`: adds, aborts, config changes, reloads), runs ``step()`` while there is work
  and blocks on the queue when there is none, hands each step's outputs to the output queue
  (`output_items`) and feeds the telemetry publisher between steps (`telemetry_feed`). Nothing
  else touches the core, so config changes are atomic between two steps by construction.
- **input thread** (`input_thread`): decodes and validates every client message off the compute
  path; a malformed one is answered with its reason and never reaches the core.
- **output thread** (`output_thread`): sends each output to its client (a finished one's text
  is detokenized there, never on the busy loop), answers ``hello``, sends heartbeats and a
  rank's ``wave`` messages; one stuck client never delays the outputs of the others.
- **control thread** (`control_server`): the control ROUTER and key. ``set_config`` and
  ``profile_*`` are queued to the busy loop and applied between two steps (`loop_control`), the
  reply sent once applied (or refused).
- the telemetry publisher's thread, the KV event publisher and ``/metrics``
  (`telemetry_outlets`), and the config file watcher (`config_watch`).
- the request trace's thread (`request_trace`): the busy loop hands it each step's stats and
  finished requests (an append); it makes the records, keeps the last minutes for
  ``get_trace`` and writes the ``request_trace`` file.

Invariants: request ids are unique among requests in flight; a client can abort only its own
requests; every accepted request gets exactly one final output, also at shutdown (``abort``),
unless its client is gone. Telemetry never stops serving (`vconsole.engine.telemetry_guard`).

A step whose model execution raises fails only its own requests (`vconsole.engine.core`); after
``max_consecutive_step_failures`` such steps in a row the loop drains and exits with
`exit_codes.STEP_FAILURES` (``exit_code``), for the supervisor to restart it.

Role: the loop reaches a data-parallel group only through the `ProcessRole` it is given
(`role`; a `LoneEngine` unless the launcher passes a rank's, `vconsole.engine.dp.rank.choose`):
a rank joins its store before anything binds, applies ``regroup`` / ``start_wave`` between
steps, and inside a wave the loop never blocks — it runs a dummy step when it has no request.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.engine.process import loop_inputs as inputs
from vconsole.engine.process.config_watch import ConfigFileWatcher
from vconsole.engine.process.control_server import ControlServer
from vconsole.engine.process.input_thread import InputThread
from vconsole.engine.process.loop_control import LoopControl
from vconsole.engine.process.loop_inputs import LoopInput
from vconsole.engine.process.output_items import STOP, OutputItem, Wave
from vconsole.engine.process.output_thread import OutputThread
from vconsole.engine.process.process_role import LoneEngine, LoopLinks, ProcessRole
from vconsole.engine.process.profile_book import ProfileBook
from vconsole.engine.process.request_intake import RequestIntake
from vconsole.engine.process.request_trace import (
    TraceBook,
    open_trace_file,
    trace_file_path,
    trace_header,
)
from vconsole.engine.process.serving_core import ServingCore
from vconsole.engine.process.sockets import bind_routers, check_before_bind
from vconsole.engine.process.stats_log import StatsLog
from vconsole.engine.process.telemetry_feed import TelemetryFeed
from vconsole.engine.process.telemetry_outlets import TelemetryOutlets
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import StepStats
from vconsole.wire import exit_codes, protocol
from vconsole.wire.liveness import LivenessStamp
from vconsole.wire.ready_file import ready_record, remove_ready_file, write_ready_file

if TYPE_CHECKING:
    from vconsole.security.curve_server import CurveAuthenticator, ServerCurve

log = logging.getLogger("vconsole.engine")

IO_POLL_MS = 200          # how often an idle I/O thread checks for shutdown
DRAIN_TIMEOUT_S = 5.0     # steps run at shutdown to deliver the final (abort) outputs
STALL_WAIT_S = 0.005      # a step that scheduled nothing is followed by this wait (no spin)
HELD_WAIT_S = 0.5         # asleep with only compiling requests: look at their timeouts so often


class EngineCoreProc:
    """Binds the sockets, loads the core, runs the busy loop; see the module docstring.

    ``role``: a data-parallel rank's (the launcher picks it), else a lone engine. ``core`` may
    be given (tests); ``input_queue`` lets `main` install signal handlers that enqueue before
    the (slow) core exists."""

    def __init__(self, config: EngineConfig, endpoints: dict[str, str], *,
                 role: ProcessRole | None = None, config_path: str | None = None,
                 allow_remote: bool = False, core: ServingCore | None = None,
                 input_queue: queue.SimpleQueue[LoopInput] | None = None,
                 control_key_file: str | None = None,
                 ready_file: str | os.PathLike[str] | None = None,
                 curve: ServerCurve | None = None,
                 restart_count: int = 0, restart_reason: str | None = None,
                 metrics_endpoint: tuple[str, int] | None = None,
                 allow_remote_metrics: bool = False,
                 liveness_file: str | os.PathLike[str] | None = None) -> None:
        check_before_bind(config, endpoints, allow_remote=allow_remote, curve=curve is not None,
                          control_key_file=control_key_file, metrics_endpoint=metrics_endpoint,
                          allow_remote_metrics=allow_remote_metrics)
        self.role: ProcessRole = role or LoneEngine()
        config = self.role.join(config)   # a data-parallel rank: reach the store first
        self.curve = curve
        self._auth: CurveAuthenticator | None = None
        self.config_path = config_path
        self.ready_file = ready_file
        self.input_queue: queue.SimpleQueue[LoopInput] = input_queue or queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue[OutputItem] = queue.SimpleQueue()
        self._io_stop = threading.Event()
        self._stopping: str | None = None       # why the busy loop is leaving
        self.state = "starting"
        self._stats_log = StatsLog()
        # Stamped on every pass, read by the supervisor to tell hung from busy (liveness.py).
        self._liveness = LivenessStamp(liveness_file) if liveness_file else None
        self.profiles = ProfileBook()           # profile on demand; written by the busy loop
        self.exit_code = exit_codes.OK          # what `vconsole engine` returns after the loop
        # Created first: its baseline is the file as loaded, so an edit made while the model
        # loads is noticed at the first poll.
        self._watcher = (ConfigFileWatcher(config_path, lambda: self.input_queue.put(
            inputs.Reload("file changed"))) if config_path else None)
        # Opened before anything binds or loads: a path that cannot be written fails at once.
        trace_path = (trace_file_path(config.request_trace, config)
                      if config.request_trace else None)
        self._trace_file = open_trace_file(trace_path) if trace_path else None
        self._trace_path = trace_path
        self.ctx = zmq.Context(io_threads=max(1, min(config.zmq_io_threads, os.cpu_count() or 1)))
        self.endpoints = dict(endpoints)
        self._sockets: dict[str, zmq.Socket] = {}
        try:
            self._bind_sockets(config, control_key_file)
            try:
                self._serve_core(core or _load_core(config), restart_count=restart_count,
                                 restart_reason=restart_reason,
                                 metrics_endpoint=metrics_endpoint)
            except BaseException:
                self.control_server.remove_key_file()   # never started: no thread
                raise
        except BaseException:
            if self._trace_file is not None:
                self._trace_file.close()
            for sock in self._sockets.values():
                sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()
            raise

    def _bind_sockets(self, config: EngineConfig, control_key_file: str | None) -> None:
        if self.curve is not None:   # the ZAP handler runs before the first CURVE socket binds
            self._auth = self.curve.start_authenticator(self.ctx)
        self._sockets = bind_routers(self.ctx, self.endpoints, config, self.curve)
        # The key file is named after the endpoint actually bound (a ``*`` port resolved).
        self.control_server = ControlServer(
            self._sockets["control"], self.endpoints["control"], key_file=control_key_file,
            config_view=lambda: self.control.view,
            submit=lambda call: self.input_queue.put(inputs.Control(call)),
            stop=self._io_stop, poll_ms=IO_POLL_MS, engine_id=config.engine_id,
            profile_view=self.profiles.view,
            trace_view=lambda window_s: self.trace.lines(window_s))

    def _serve_core(self, core: ServingCore, *, restart_count: int, restart_reason: str | None,
                    metrics_endpoint: tuple[str, int] | None) -> None:
        """The core exists: intake, threads, telemetry (opened last of what may fail), control."""
        self.core = core
        core.set_wakeup(lambda: self.input_queue.put(inputs.Wake()))
        self.intake = RequestIntake(core, self.input_queue, self.output_queue)
        model = core.model_info()
        self.ready_info = {
            "engine_id": core.config.engine_id, "model": core.config.model,
            "model_path": model.get("model_path"),
            "vocab_size": model["vocab_size"], "max_model_len": model["max_model_len"],
            "block_size": core.config.block_size, "num_kv_blocks": model["num_kv_blocks"],
            "dp_rank": core.config.dp_rank, "data_parallel_size": core.config.data_parallel_size,
            "kv_cache_dtype": model.get("kv_cache_dtype"),
            "kv_bytes_per_token": model.get("kv_bytes_per_token"),
        }
        self._threads: list[threading.Thread] = [
            InputThread(self._sockets["input"], inputs=self.input_queue,
                        outputs=self.output_queue, config=lambda: self.control.view[1],
                        max_model_len=model["max_model_len"], role=self.role,
                        stop=self._io_stop, poll_ms=IO_POLL_MS),
            OutputThread(self._sockets["output"], self.output_queue, ready=self._ready,
                         heartbeat_s=lambda: self.control.view[1].client_heartbeat_s,
                         engine_id=core.config.engine_id, detokenize=core.detokenize,
                         on_client_gone=lambda c: self.input_queue.put(inputs.ClientGone(c))),
        ]
        self.outlets = TelemetryOutlets.open(
            self.ctx, core, self.endpoints["telemetry"], device=model["device"], curve=self.curve,
            restart_count=restart_count, restart_reason=restart_reason,
            metrics_endpoint=metrics_endpoint)
        self.publisher, self.metrics = self.outlets.publisher, self.outlets.metrics
        self.endpoints["telemetry"] = self.publisher.endpoint
        self.guard = core.telemetry_guard   # observability never stops serving
        self.feed = TelemetryFeed(core, self.publisher, self.role.dp_body)
        self.trace = TraceBook(trace_header(core.config, model), core.config,
                               core.config_version)
        if self._trace_file is not None:
            self.trace.use_file(self._trace_file, self._trace_path)
        self.control = LoopControl(core, self.profiles, self.publisher,
                                   config_path=self.config_path, stopping=lambda: self._stopping,
                                   on_change=lambda: self.outlets.publish_kv_events(core),
                                   trace=self.trace)
        self.role.attach(LoopLinks(
            device=model["device"], submit_wave=self.publisher.submit_wave,
            submit_dp=self.publisher.submit_dp, changed=self._changed,
            send_wave=lambda event, wave: self.output_queue.put(Wave(event, wave))))

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the I/O threads (the busy loop then runs in the caller's thread)."""
        for t in self._threads:
            t.start()
        self.trace.start()
        self.control_server.start()
        if self._watcher is not None:
            self._watcher.start()
        self.control.publish_config()
        self._set_state("idle")
        record = ready_record(pid=os.getpid(), endpoints=self.endpoints,
                              control_key_file=self.control_server.key_file, **self.ready_info,
                              **self.outlets.ready_fields())
        if self.ready_file is not None:
            write_ready_file(self.ready_file, record)
        self.role.publish_ready(record)     # a rank's front end finds it through the store

    def request_shutdown(self, reason: str) -> None:
        """Safe from any thread and from signal handlers."""
        self.input_queue.put(inputs.Shutdown(reason))

    def request_reload(self, reason: str) -> None:   # as SIGHUP does
        self.input_queue.put(inputs.Reload(reason))

    def run_busy_loop(self) -> None:
        """The loop: inputs, one step, telemetry — until asked to stop; then drain and close."""
        while self._stopping is None:
            self._beat()
            self._process_input_queue()
            self._process_engine_step()
            self.feed.maybe_snapshot(self.state)
            self.guard.run("step", self._stats_log.maybe_log, self.core)
        self._shutdown()

    # --- busy loop ------------------------------------------------------------------------------

    def _beat(self, busy: bool | None = None) -> None:
        if self._liveness is not None:
            if busy is None:
                busy = self.core.has_unfinished_requests() or self.role.in_wave
            self._liveness.beat(busy)

    def _process_input_queue(self) -> None:
        """Apply every queued input. With no work, block for the first one (waking only to send
        the snapshot that shows the drained state), so an idle engine costs nothing. A
        data-parallel rank inside a wave never blocks: it must keep stepping."""
        idle = not self.core.has_unfinished_requests()
        if idle:
            self._set_state("idle")
        # Every request waits for its grammar to compile: sleep as when idle; the compile
        # thread's `inputs.Wake` ends the wait (checked after the queue was, so none is lost:
        # the ready list is filled before the wake-up is queued).
        held = not idle and not self.core.has_ready_requests()
        if held and not self.role.in_wave:
            # Waiting on the compile threads is not a stuck step: the hang watchdog must not
            # kill an engine whose only requests compile (the next beat says busy again).
            self._beat(busy=False)
        if (idle or held) and not self.role.in_wave:
            wait = 1.0 / self.core.config.telemetry_hz if self.feed.dirty else None
            stats_wait = self._stats_log.wait_s(self.core.config)
            if stats_wait is not None:
                wait = stats_wait if wait is None else min(wait, stats_wait)
            if held and self.core.config.max_holding_seconds is not None:
                wait = HELD_WAIT_S if wait is None else min(wait, HELD_WAIT_S)  # timeouts
            try:
                self._handle_input(self.input_queue.get(timeout=wait))
            except queue.Empty:
                return
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(item)

    def _process_engine_step(self) -> None:
        """One step: a real one when there are requests; in a data-parallel wave without
        requests a dummy one; the role's hooks around it (a rank's waves)."""
        if self._stopping is not None:
            return
        self.role.before_step(self.core.has_unfinished_requests())
        dummy = not self.core.has_unfinished_requests()
        if dummy and not self.role.in_wave:
            return
        self._beat(True)            # a step is about to run: from here, no pass means hung
        if not dummy:
            self._real_step()
        else:
            self.core.dummy_step()
            self._check_step_failures()
        self.role.after_step(dummy, self.core.has_unfinished_requests())

    def _real_step(self) -> None:
        self._set_state("running")
        outputs, scheduled = self.core.step()
        if self.core.last_step is not None:
            self.guard.run("step", self._record_step, self.core.last_step)
        self._trace_step()
        if self.profiles.active is not None:
            self.profiles.after_step()
        self.intake.emit(outputs)
        self.outlets.publish_kv_events(self.core)
        self._changed()
        self._check_step_failures()
        if not scheduled:
            with contextlib.suppress(queue.Empty):
                self._handle_input(self.input_queue.get(timeout=STALL_WAIT_S))

    def _record_step(self, step: StepStats) -> None:
        self.publisher.record_step(step)
        self._stats_log.record(step)

    def _trace_step(self) -> None:
        """The step just run, and the requests it finished, to the request trace (O(1))."""
        core = self.core
        if core.last_step is not None:
            self.guard.run("step", self.trace.add_step, core.last_step, core.last_finished,
                           core.config_version)

    def _check_step_failures(self) -> None:
        """Model execution failed on ``max_consecutive_step_failures`` steps in a row: this
        process cannot serve any more, so drain (every request left gets its final output) and
        exit with `exit_codes.STEP_FAILURES`, for the supervisor to start a fresh process."""
        failures = self.core.consecutive_step_failures
        if failures < self.core.config.max_consecutive_step_failures \
                or self.exit_code != exit_codes.OK:
            return
        self.exit_code = exit_codes.STEP_FAILURES
        log.critical("model execution failed on %d steps in a row (last: %s): stopping the "
                     "engine with exit code %d so that it is restarted", failures,
                     self.core.last_step_error, exit_codes.STEP_FAILURES)
        self.request_shutdown("model execution keeps failing")

    def _changed(self) -> None:   # the next idle wait ends in time for a snapshot
        self.feed.dirty = True

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.publisher.set_state(state)
            self._changed()

    def _handle_input(self, item: LoopInput) -> None:
        match item:
            case inputs.Add(client_id, msg):
                self.intake.add(client_id, msg, refuse=self._stopping and
                                protocol.SHUTTING_DOWN)
            case inputs.AddReady(engine_id, client_id, result):
                self.intake.add_ready(engine_id, client_id, result)
            case inputs.Reject(client_id, request_id, reason):
                self.intake.reject_message(client_id, request_id, reason)
            case inputs.Abort(client_id, request_ids):
                self.intake.abort(client_id, request_ids)
            case inputs.Control(call):
                self.control.apply(call)
            case inputs.ClientGone(client_id):
                self.intake.client_gone(client_id)
            case inputs.Reload(reason):
                self.control.reload(reason)
            case inputs.FrontEnd(kind, value) if self._stopping is None:  # leaving: no group
                self.role.on_front_end(kind, value)
            case inputs.Wake():
                pass        # a grammar is ready: the next step takes it
            case inputs.Shutdown(reason) if self._stopping is None:
                log.info("%s: stopping", reason)
                self._stopping = reason
        self._changed()

    def _shutdown(self) -> None:
        """Stop taking requests, abort those in flight (not a drain: they are not finished
        first) and deliver their final outputs (finish_reason ``abort``), answer
        any queued control call, then join every thread and close every socket."""
        self._set_state("draining")
        self.role.close()           # a rank's peers in a collective with it go uncoordinated
        self.profiles.cancel(None, "cancelled: the engine is shutting down")
        if self.ready_file is not None:
            remove_ready_file(self.ready_file, os.getpid())
        self._io_stop.set()
        self._threads[0].join()                      # input: no new messages from here on
        if self._watcher is not None:
            self._watcher.stop()
        self._drain_queue()
        in_flight = len(self.intake.requests.engine_ids())
        if in_flight:     # a stop is not a drain: what is in flight ends now, as aborted
            log.warning("stopping with %d request(s) in flight: each ends with finish_reason "
                        "'abort' (its client gets that final output)", in_flight)
        self.intake.abort_all()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.core.has_unfinished_requests() and time.monotonic() < deadline:
            outputs, _ = self.core.step()
            self._trace_step()
            self.intake.emit(outputs)
        self.feed.submit_snapshot("draining")
        while self.control_server.is_alive():        # control: may wait on a queued call
            self._drain_queue()
            self.control_server.join(0.05)
        self.output_queue.put(STOP)
        self._threads[1].join()                      # output: flushes everything queued first
        self.trace.close()                           # the trace file gets its last lines
        self.core.close()                            # grammar compiles still queued: dropped
        self.outlets.close()
        if self._auth is not None:                   # its sockets live in this context
            self._auth.stop()
        # Every other socket was closed by its thread; destroy closes what is left (never
        # term() alone: it waits forever for a socket still open).
        self.ctx.destroy(linger=0)
        log.info("engine stopped (%s)", self._stopping)

    def _ready(self) -> dict[str, Any]:
        """The ``ready`` answer to a ``hello`` (output thread). A CURVE rank adds its
        ``control_key``: only its front end's key is authorised there, and the front end may be
        on another host (over plain loopback/ipc the key stays in its 0600 file)."""
        version, config = self.control.view
        info = {**self.ready_info, "config_version": version,
                "heartbeat_interval_s": config.client_heartbeat_s}
        if self.curve is not None and self.role.is_rank:
            info["control_key"] = self.control_server.key
        return info

    def _drain_queue(self) -> None:
        while True:
            try:
                self._handle_input(self.input_queue.get_nowait())
            except queue.Empty:
                return


def freeze_startup_heap() -> None:
    """For a process that is the engine (``vconsole engine``, a Ray rank actor), once its core
    is built: what start-up made (the model, the caches, torch's and transformers' modules)
    lives as long as the process, so it is frozen out of the cyclic collector, as vLLM does once
    its engine is up. No collection walks it again; the exit's final one had taken ~1 s of CPU.
    Not called by `EngineCoreProc` itself: a process that embeds one keeps its collector."""
    gc.collect()
    gc.freeze()


def _load_core(config: EngineConfig) -> ServingCore:
    """The engine core; torch is imported only here, once the sockets are ours (a busy port
    fails fast)."""
    from vconsole.engine.core import EngineCore

    return EngineCore(config)
