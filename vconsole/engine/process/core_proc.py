"""EngineCoreProc: the EngineCore as a live process — I/O threads and queues around the core.

Threads and what each one owns (a ZeroMQ socket is bound in the constructor, so a busy port fails
fast, and from then on is touched only by its one thread, which also closes it):

- **busy loop** (the main thread): the `EngineCore` itself. It drains the input queue (adds,
  aborts, config changes, reloads), runs ``step()`` while there is work and blocks on the queue
  when there is none, hands each step's outputs to the output queue, and feeds the telemetry
  publisher between steps. Nothing else touches the core, so config changes are atomic between
  two steps by construction.
- **input thread**: the input ROUTER (many clients). Decodes and validates each message
  (`vconsole.engine.client.protocol`) off the compute path; a malformed one is answered with its reason and
  never reaches the core.
- **output thread** (`vconsole.engine.process.output_thread`): the output ROUTER. Encodes outputs
  and sends each to the client that sent the request (its routing identity), answers ``hello``
  with ``ready``, sends heartbeats (and a data-parallel rank's ``wave`` messages).
- **control thread**: the control ROUTER and the control key, owned by the `ControlServer`
  (`vconsole.engine.process.control_server`). ``get_config`` is answered from the busy loop's last
  published config; ``set_config`` is queued to the busy loop (``CONTROL``) and applied there
  between two steps (`_apply_control`), its reply sent only after it was applied (or refused).
  A ``set_config`` without the control key is refused by the server and never queued.
- the telemetry publisher's thread (`vconsole.engine.publish.publisher`) and the config file watcher.
- with ``metrics_endpoint`` (``--metrics-port``): the Prometheus HTTP server
  (`vconsole.engine.publish.prometheus`), whose threads read only what the publisher last sent.

Routing: a client connects two DEALERs with one identity (its client id): requests on input,
outputs on output. The output ROUTER is ``ROUTER_MANDATORY``: an output for a client that is no
longer connected raises instead of vanishing. Outputs are sent without blocking: a client that
is no longer connected, or whose queue is full (``zmq_sndhwm`` messages: it stopped reading), is
marked gone at once — its requests aborted, whatever is still queued for it dropped — so one
stuck client never delays the outputs of the others.
A client's ``hello`` arrives on input (forwarded by the input thread to the output thread); the
output thread retries ``ready`` until the client's output connection is registered, so once a
client has its ``ready`` no output to it can be lost.

Invariants: request ids are unique among requests in flight (engine-wide); a client can abort
only its own requests; every request that was accepted gets exactly one final output, including
at shutdown (``abort``), unless its client is gone.

Telemetry never stops serving: every telemetry call of the busy loop (step records, the
snapshot's request rows, KV figures and latency, a rank's ``dp`` figures, the stats line) runs
behind the core's `vconsole.engine.telemetry_guard.TelemetryGuard`, which logs, counts (health
``telemetry_errors``), alerts and rebuilds the failing cache instead of raising.

``log_stats`` (hot): the busy loop logs one stats line every few seconds while there is work
(`vconsole.engine.process.stats_log`). Which endpoints may bind beyond loopback: `vconsole.security.bind_policy`.

A step whose model execution raises fails only its own requests (`vconsole.engine.core`); after
``max_consecutive_step_failures`` such steps in a row the loop drains and the process exits with
`vconsole.engine.launch.exit_codes.STEP_FAILURES` (``exit_code``), for the supervisor to restart
it (`vconsole.engine.launch.supervisor`).

Data parallel: with ``data_parallel_size > 1`` (or under torchrun) the process is one rank of a
group (`vconsole.engine.dp`): it joins the rendezvous store before binding anything. The
loop reaches its group only through its role (`vconsole.engine.process.role`: a `LoneEngine`, or
the rank's `DPRank`) — ``regroup`` / ``start_wave`` from the front end are applied between
steps, and inside a wave the loop never blocks: it runs a dummy step when it has no request,
and every ``dp_sync_every`` steps asks the group whether any rank is still busy.

Profile on demand: a ``profile_start`` control call arms the core's profiler between two steps
(`_profile_start`); the core runs it over its next steps while the loop keeps serving, and after
each step the loop notes its progress in ``profiles`` (`vconsole.engine.process.profile_book`), which
the control thread reads for ``profile_status``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.engine.client import protocol
from vconsole.engine.launch import exit_codes
from vconsole.engine.launch.liveness import LivenessStamp
from vconsole.engine.launch.ready_file import ready_record, remove_ready_file, write_ready_file
from vconsole.engine.process.config_watch import ConfigFileWatcher, apply_file, read_file
from vconsole.engine.process.control_server import ControlCall, ControlServer
from vconsole.engine.process.loop_inputs import (
    Abort,
    Add,
    AddReady,
    ClientGone,
    Control,
    FrontEnd,
    LoopInput,
    Reject,
    Reload,
    Shutdown,
)
from vconsole.engine.process.output_thread import STOP, OutputThread
from vconsole.engine.process.profile_book import ProfileBook
from vconsole.engine.process.request_intake import RequestIntake
from vconsole.engine.process.role import LoneEngine, ProcessRole
from vconsole.engine.process.serving_core import ServingCore
from vconsole.engine.process.stats_log import StatsLog
from vconsole.engine.publish.kv_events import kv_event_endpoints, start_kv_events
from vconsole.engine.publish.prometheus import MetricsServer, TelemetryCollector
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.security.bind_policy import (
    check_endpoints,
    check_metrics_host,
    secure_socket,
)
from vconsole.security.control_key import key_path
from vconsole.security.engine_key import refuse_if_held
from vconsole.shared.config import ConfigUpdate, EngineConfig
from vconsole.shared.stats import StepStats
from vconsole.telemetry import control

if TYPE_CHECKING:
    from vconsole.engine.dp.rank.role import WaveEvent
    from vconsole.security.curve_server import CurveAuthenticator, ServerCurve

log = logging.getLogger("vconsole.engine")

IO_POLL_MS = 200          # how often an idle I/O thread checks for shutdown
DRAIN_TIMEOUT_S = 5.0     # steps run at shutdown to deliver the final (abort) outputs
STALL_WAIT_S = 0.005      # a step that scheduled nothing is followed by this wait (no spin)
PUBLISHER_CLOSE_S = 5.0   # at shutdown, how long the telemetry thread gets to stop
LATENCY_INTERVAL_S = 1.0  # latency percentiles are computed at most this often




class EngineCoreProc:
    """Binds the sockets, loads the core, runs the busy loop; see the module docstring.

    ``core`` may be given (tests); ``input_queue`` lets `main` install signal handlers that
    enqueue before the (slow) core exists."""

    def __init__(self, config: EngineConfig, endpoints: dict[str, str], *,
                 config_path: str | None = None, allow_remote: bool = False,
                 core: ServingCore | None = None,
                 input_queue: queue.SimpleQueue[LoopInput] | None = None,
                 control_key_file: str | None = None,
                 ready_file: str | os.PathLike[str] | None = None,
                 curve: ServerCurve | None = None,
                 restart_count: int = 0, restart_reason: str | None = None,
                 metrics_endpoint: tuple[str, int] | None = None,
                 allow_remote_metrics: bool = False,
                 liveness_file: str | os.PathLike[str] | None = None) -> None:
        check_endpoints(endpoints, allow_remote, curve=curve is not None)
        check_endpoints(kv_event_endpoints(config), allow_remote)   # never CURVE: see there
        if metrics_endpoint is not None:   # (host, port): Prometheus /metrics, port 0 = any
            check_metrics_host(metrics_endpoint[0], allow_remote_metrics)
        self.metrics: MetricsServer | None = None
        refuse_if_held(key_path(endpoints["control"], control_key_file))  # before any bind
        config, self.role = _role(config)  # a data-parallel rank: reach the store first
        self.curve = curve
        self._auth: CurveAuthenticator | None = None
        self.config_path = config_path
        self.ready_file = ready_file
        self.input_queue: queue.SimpleQueue[LoopInput] = input_queue or queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._io_stop = threading.Event()
        self._stopping: str | None = None       # why the busy loop is leaving
        self._next_latency = 0.0                # when the next latency snapshot is due
        self._dirty = True                      # state changed since the last snapshot
        self.state = "starting"
        self._stats_log = StatsLog()
        # Stamped on every pass, read by the supervisor to tell hung from busy (liveness.py).
        self._liveness = LivenessStamp(liveness_file) if liveness_file else None
        self.profiles = ProfileBook()           # profile on demand; written by the busy loop
        self.exit_code = exit_codes.OK            # what `vconsole engine` returns after the loop
        # Created first: its baseline is the file as loaded, so an edit made while the model
        # loads is noticed at the first poll.
        self._watcher = (ConfigFileWatcher(config_path, lambda: self.input_queue.put(
            Reload("file changed"))) if config_path else None)

        self.ctx = zmq.Context(io_threads=max(1, min(config.zmq_io_threads, os.cpu_count() or 1)))
        self.endpoints = dict(endpoints)
        self._sockets: dict[str, zmq.Socket] = {}
        undo: list[Callable[[], object]] = []     # what a failed start must take back
        try:
            if curve is not None:   # the ZAP handler runs before the first CURVE socket binds
                self._auth = curve.start_authenticator(self.ctx)
            self._sockets["input"] = self._bind(zmq.ROUTER, "input", config)
            self._sockets["output"] = self._bind(zmq.ROUTER, "output", config)
            self._sockets["control"] = self._bind(zmq.ROUTER, "control", config)
            # The key file is named after the endpoint actually bound (a ``*`` port resolved).
            self.control_server: ControlServer = ControlServer(
                self._sockets["control"], self.endpoints["control"], key_file=control_key_file,
                config_view=lambda: self._config_view,
                submit=lambda call: self.input_queue.put(Control(call)),
                stop=self._io_stop, poll_ms=IO_POLL_MS, engine_id=config.engine_id,
                profile_view=self.profiles.view)
            undo.append(self.control_server.remove_key_file)   # never started: no thread
            out = self._sockets["output"]
            out.setsockopt(zmq.ROUTER_MANDATORY, 1)

            if core is None:
                from vconsole.engine.core import EngineCore  # torch: only once the sockets are ours
                core = EngineCore(config)
            self.core: ServingCore = core
            self.intake = RequestIntake(core, self.input_queue, self.output_queue)
            model = core.model_info()
            self.role.device = model["device"]
            self.publisher = TelemetryPublisher(self.ctx, endpoints["telemetry"],
                                                core.config.engine_id, core.config.dp_rank,
                                                core.config, secure=lambda sock: secure_socket(
                                                    sock, "telemetry", endpoints["telemetry"],
                                                    curve),
                                                restart_count=restart_count,
                                                restart_reason=restart_reason)
            undo.append(lambda: self.publisher.close(PUBLISHER_CLOSE_S))
            self.publisher.start()
            self.endpoints["telemetry"] = self.publisher.endpoint
            self.kv_events = start_kv_events(self.ctx, core.config, model["device"])
            if self.kv_events is not None:
                core.enable_kv_events()
                undo.append(self.kv_events.close)
            self.guard = core.telemetry_guard   # observability never stops serving
            self.guard.on_failure = self.publisher.report_error
            if metrics_endpoint is not None:  # figures = what the publisher last sent
                self.metrics = MetricsServer(TelemetryCollector(
                    self.publisher, model_name=core.config.model, engine=core.config.dp_rank),
                    *metrics_endpoint).start()
        except BaseException:
            for take_back in reversed(undo):
                take_back()
            for sock in self._sockets.values():
                sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()
            raise
        self._config_view = (core.config_version, core.config)  # read by the I/O threads
        self.ready_info = {
            "engine_id": core.config.engine_id, "model": core.config.model,
            "model_path": model.get("model_path"),
            "vocab_size": model["vocab_size"], "max_model_len": model["max_model_len"],
            "block_size": core.config.block_size, "num_kv_blocks": model["num_kv_blocks"],
            "dp_rank": core.config.dp_rank, "data_parallel_size": core.config.data_parallel_size,
        }
        self._threads = [
            threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
            OutputThread(self._sockets["output"], self.output_queue, ready=self._ready,
                         heartbeat_s=lambda: self._config_view[1].client_heartbeat_s,
                         engine_id=core.config.engine_id,
                         on_client_gone=lambda c: self.input_queue.put(ClientGone(c))),
        ]

    def _bind(self, kind: int, name: str, config: EngineConfig) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, config.zmq_linger_ms)
            sock.setsockopt(zmq.SNDHWM, config.zmq_sndhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, config.zmq_maxmsgsize)
            secure_socket(sock, name, self.endpoints[name], self.curve)
            sock.bind(self.endpoints[name])
            self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoints[name]
        except zmq.ZMQError as e:
            sock.close(0)
            raise OSError(f"cannot bind the {name} socket to {self.endpoints[name]}: {e}") from None
        return sock

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the I/O threads (the busy loop then runs in the caller's thread)."""
        for t in self._threads:
            t.start()
        self.control_server.start()
        if self._watcher is not None:
            self._watcher.start()
        self._publish_config()
        self._set_state("idle")
        record = ready_record(pid=os.getpid(), endpoints=self.endpoints,
                              control_key_file=self.control_server.key_path, **self.ready_info,
                              **({"metrics": self.metrics.url} if self.metrics else {}),
                              **({"kv_events": {"endpoint": self.kv_events.endpoint,
                                                "replay_endpoint": self.kv_events.replay_endpoint}}
                                 if self.kv_events else {}))
        if self.ready_file is not None:
            write_ready_file(self.ready_file, record)
        self.role.publish_ready(record)     # a rank's front end finds it through the store

    def request_shutdown(self, reason: str) -> None:
        """Safe from any thread and from signal handlers."""
        self.input_queue.put(Shutdown(reason))

    def request_reload(self, reason: str) -> None:
        self.input_queue.put(Reload(reason))

    def run_busy_loop(self) -> None:
        """The loop: inputs, one step, telemetry — until asked to stop; then drain and close."""
        while self._stopping is None:
            self._beat()
            self._process_input_queue()
            self._process_engine_step()
            self._maybe_snapshot()
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
        if idle and not self.role.in_wave:
            wait = 1.0 / self.core.config.telemetry_hz if self._dirty else None
            stats_wait = self._stats_log.wait_s(self.core.config)
            if stats_wait is not None:
                wait = stats_wait if wait is None else min(wait, stats_wait)
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
        """One step: a real one when there are requests; on a data-parallel rank in a wave
        without requests a dummy one; then the rank's wave bookkeeping (`DPRank`)."""
        role = self.role
        if self._stopping is not None:
            return
        if ev := role.maybe_start(self.core.has_unfinished_requests()):
            self._announce_wave(ev)
        dummy = not self.core.has_unfinished_requests()
        if dummy and not role.in_wave:
            return
        self._beat(True)            # a step is about to run: from here, no pass means hung
        if not dummy:
            self._real_step()
        else:
            self.core.dummy_step()
            self._check_step_failures()
        if ev := role.after_step(dummy, self.core.has_unfinished_requests()):
            self._announce_wave(ev)

    def _announce_wave(self, ev: WaveEvent) -> None:
        """A wave started or completed here: the ``wave`` topic, and (``notify``) a ``wave``
        message to every client that said hello — in data parallel, the front end."""
        self.publisher.submit_wave(ev.body)
        if ev.notify:
            self.output_queue.put((protocol.WAVE, b"", ev.event, ev.wave))
        self._dirty = True

    def _front_end_message(self, kind: str, value: int) -> None:
        """The front end's ``regroup`` or ``start_wave``, between two steps."""
        if self._stopping is not None:
            return              # leaving: never block on a group again
        if ev := self.role.on_front_end(kind, value, self.publisher.submit_dp):
            self._announce_wave(ev)

    def _real_step(self) -> None:
        self._set_state("running")
        outputs, scheduled = self.core.step()
        if self.core.last_step is not None:
            self.guard.run("step", self._record_step, self.core.last_step)
        if self.profiles.active is not None:
            self.profiles.after_step()
        self.intake.emit(outputs)
        if self.kv_events is not None:
            self.guard.run("kv_events", self._publish_kv_events)
        self._dirty = True
        self._check_step_failures()
        if not scheduled:
            with contextlib.suppress(queue.Empty):
                self._handle_input(self.input_queue.get(timeout=STALL_WAIT_S))

    def _publish_kv_events(self) -> None:
        assert self.kv_events is not None
        self.kv_events.publish(self.core.take_kv_events())

    def _record_step(self, step: StepStats) -> None:
        self.publisher.record_step(step)
        self._stats_log.record(step)

    def _check_step_failures(self) -> None:
        """Model execution failed on ``max_consecutive_step_failures`` steps in a row (each
        failure already failed its own requests, `vconsole.engine.core`): this process cannot
        serve any more, so drain (every request left gets its final output) and exit with
        `exit_codes.STEP_FAILURES`, for the supervisor to start a fresh process."""
        failures = self.core.consecutive_step_failures
        if failures < self.core.config.max_consecutive_step_failures \
                or self.exit_code != exit_codes.OK:
            return
        self.exit_code = exit_codes.STEP_FAILURES
        log.critical("model execution failed on %d steps in a row (last: %s): stopping the "
                     "engine with exit code %d so that it is restarted", failures,
                     self.core.last_step_error, exit_codes.STEP_FAILURES)
        self.request_shutdown("model execution keeps failing")

    def _maybe_snapshot(self) -> None:
        """The telemetry snapshot, at most ``telemetry_hz`` times a second. Each part runs
        behind the guard: one that raises is logged, counted and rebuilt, and is missing from
        this snapshot only (`vconsole.engine.telemetry_guard`)."""
        if not self.publisher.snapshot_due():
            return
        # A snapshot a guarded part failed leaves the engine dirty: an idle loop wakes once
        # more to send the drained state instead of blocking on a stale one.
        self._dirty = not self._submit_snapshot(self.state)
        core, run = self.core, self.guard.run
        dp_body = run("dp", self.role.dp_body)
        if dp_body is not None:
            self.publisher.submit_dp(dp_body)
        now = time.monotonic()
        # Idle: this is the last snapshot before the loop blocks, so latency goes too.
        if now >= self._next_latency or not core.has_unfinished_requests():
            body = run("latency", core.latency_snapshot)
            if body is not None:
                self.publisher.submit_latency(body)
            self._next_latency = now + LATENCY_INTERVAL_S

    def _submit_snapshot(self, state: str) -> bool:
        """Send the scheduler and KV snapshot; False when a guarded part failed."""
        core, run = self.core, self.guard.run
        sched = run("sched", core.scheduler_stats, core.config.telemetry_max_requests)
        kv = run("kv", core.kv_stats)
        if sched is None or kv is None:
            return False
        self.publisher.submit_snapshot(sched, kv, state, core.num_steps)
        return True

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.publisher.set_state(state)
            self._dirty = True

    def _handle_input(self, item: LoopInput) -> None:
        match item:
            case Add(client_id, msg):
                self.intake.add(client_id, msg, refuse=self._stopping and
                                protocol.SHUTTING_DOWN)
            case AddReady(engine_id, client_id, result):
                self.intake.add_ready(engine_id, client_id, result)
            case Reject(client_id, request_id, reason):
                self.intake.reject_message(client_id, request_id, reason)
            case Abort(client_id, request_ids):
                self.intake.abort(client_id, request_ids)
            case Control(call):
                self._apply_control(call)
            case ClientGone(client_id):
                self.intake.client_gone(client_id)
            case Reload(reason):
                self._reload_config_file(reason)
            case FrontEnd(kind, value):
                self._front_end_message(kind, value)
            case Shutdown(reason) if self._stopping is None:
                log.info("%s: draining", reason)
                self._stopping = reason
        self._dirty = True

    def _apply_control(self, call: ControlCall) -> None:
        """The busy loop's half of a ``set_config`` (`vconsole.engine.process.control_server`):
        applied here, between two steps, unless the control thread gave up on it."""
        if call.op == "profile_start":
            call.run(self._profile_start)
        elif call.op == "profile_cancel":
            call.run(self._profile_cancel)
        else:
            call.run(self._set_config)

    def _profile_start(self, fields: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        if self._stopping is not None:
            return control.error_reply(protocol.SHUTTING_DOWN, request_id)
        try:
            return control.profile_reply(self.profiles.start(self.core, fields["steps"]),
                                         request_id)
        except ValueError as e:
            return control.error_reply(str(e), request_id)

    def _profile_cancel(self, fields: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        try:
            return control.profile_reply(self.profiles.cancel(fields["profile"]), request_id)
        except ValueError as e:
            return control.error_reply(str(e), request_id)

    def _set_config(self, values: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        if self._stopping is not None:
            return control.error_reply(protocol.SHUTTING_DOWN, request_id)
        update = self.core.apply_config(values)
        self._after_config_change(update, "set_config")
        return control.config_reply(self.core.config_version, self.core.config.to_dict(),
                                    update, request_id=request_id)

    def _reload_config_file(self, reason: str) -> None:
        if not self.config_path:
            log.info("%s: no --config file to reload", reason)
            return
        try:
            values = read_file(self.config_path)
        except ValueError as e:
            log.error("config reload (%s) failed: %s", reason, e)
            return
        update = apply_file(self.core.apply_config, self.core.config, values)
        self._after_config_change(update, f"{self.config_path} ({reason})")
        for key, why in update.rejected.items():
            log.error("config reload (%s): %s rejected: %s", reason, key, why)
        for key in update.restart_required:
            log.warning("config reload (%s): %s changed in the file: restart_required (the "
                        "running value stays until the engine restarts)", reason, key)

    def _after_config_change(self, update: ConfigUpdate, source: str) -> None:
        if not update.applied:
            return
        log.info("config v%d from %s: %s", self.core.config_version, source,
                 ", ".join(f"{k}={v}" for k, v in update.applied.items()))
        self._config_view = (self.core.config_version, self.core.config)
        self.publisher.update_config(self.core.config)
        self._publish_config()
        if self.kv_events is not None:   # prefix caching switched off: AllBlocksCleared now
            self.guard.run("kv_events", self._publish_kv_events)

    def _publish_config(self) -> None:
        self.publisher.publish_config(self.core.config_version, self.core.config.to_dict())

    def _shutdown(self) -> None:
        """Stop taking requests, abort those in flight and deliver their final outputs, answer
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
        self.intake.abort_all()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.core.has_unfinished_requests() and time.monotonic() < deadline:
            outputs, _ = self.core.step()
            self.intake.emit(outputs)
        self._submit_snapshot("draining")
        while self.control_server.is_alive():        # control: may wait on a queued call
            self._drain_queue()
            self.control_server.join(0.05)
        self.output_queue.put(STOP)
        self._threads[1].join()                      # output: flushes everything queued first
        if self.metrics is not None:
            self.metrics.close()
        if self.kv_events is not None:
            self.kv_events.close(PUBLISHER_CLOSE_S)
        self.publisher.close(PUBLISHER_CLOSE_S)
        if self.publisher.is_alive():
            log.warning("the telemetry thread did not stop within %g s; closing its socket",
                        PUBLISHER_CLOSE_S)
        if self._auth is not None:                   # its sockets live in this context
            self._auth.stop()
        # Every other socket was closed by its thread; destroy closes what is left (never
        # term() alone: it waits forever for a socket still open).
        self.ctx.destroy(linger=0)
        log.info("engine stopped (%s)", self._stopping)

    def _ready(self) -> dict[str, Any]:
        """The ``ready`` answer to a ``hello`` (read by the output thread). A data-parallel
        rank whose sockets are CURVE servers adds its ``control_key``: only its front end's key
        is authorised there, and the front end may be on another host, where the key file is
        not (over plain loopback/ipc the key stays in its 0600 file)."""
        info = {**self.ready_info, "config_version": self._config_view[0],
                "heartbeat_interval_s": self._config_view[1].client_heartbeat_s}
        if self.curve is not None and self.role.is_rank:
            info["control_key"] = self.control_server.key
        return info

    def _drain_queue(self) -> None:
        while True:
            try:
                self._handle_input(self.input_queue.get_nowait())
            except queue.Empty:
                return

    # --- input thread ----------------------------------------------------------------------------

    def _input_loop(self) -> None:
        sock = self._sockets["input"]
        try:
            while not self._io_stop.is_set():
                if sock.poll(IO_POLL_MS):
                    self._on_input(sock.recv_multipart(copy=False))
        finally:
            sock.close()

    def _on_input(self, frames: list[zmq.Frame]) -> None:
        client_id = frames[0].bytes
        try:
            header = protocol.decode([f.buffer for f in frames[1:]])
            kind = header["type"]
            if kind == protocol.ADD:
                config = self._config_view[1]
                max_len = self.ready_info.get("max_model_len")
                msg = protocol.parse_add(header, max_prompt_chars=config.max_prompt_chars,
                                         max_prompt_tokens=max_len - 1 if max_len else None)
                self.input_queue.put(Add(client_id, msg))
            elif kind == protocol.ABORT:
                self.input_queue.put(Abort(client_id, protocol.parse_abort(header)))
            elif kind == protocol.HELLO:
                self.output_queue.put((protocol.HELLO, client_id))
            elif kind in (protocol.START_WAVE, protocol.REGROUP):
                if not self.role.is_rank:
                    raise protocol.ProtocolError(f"{kind}: this engine is not a data-parallel "
                                                 "rank (data_parallel_size 1)")
                self.input_queue.put(FrontEnd(kind, protocol.parse_start_wave(header)
                                              if kind == protocol.START_WAVE
                                              else protocol.parse_regroup(header)))
            else:
                raise protocol.ProtocolError(f"unknown message type {kind!r}",
                                             protocol.request_id_of(header))
        except protocol.ProtocolError as e:
            log.warning("rejected a message from client %s: %s",
                        client_id.decode(errors="replace"), e.reason)
            if e.request_id is not None:    # the busy loop knows whether it is in flight
                self.input_queue.put(Reject(client_id, e.request_id, e.reason))
            else:
                self.output_queue.put((protocol.ERROR, client_id, e.reason, None, False))


def _role(config: EngineConfig) -> tuple[EngineConfig, ProcessRole]:
    """The process's role: a data-parallel rank (flags or torchrun's environment,
    `vconsole.engine.dp`) — its config with the rank's values and its `DPRank`, connected
    to the store — else ``config`` and a `LoneEngine`. Raises `RendezvousError` (an OSError)
    when the store cannot be reached."""
    from vconsole.engine.dp.rank.rendezvous import DPEnv

    env = DPEnv.from_config(config)
    if not env.is_rank:
        return config, LoneEngine()
    from vconsole.engine.dp.rank.role import DPRank, split_cpu_threads  # torch: ranks only

    config = env.apply(config)
    rank = DPRank(env, config)
    threads = split_cpu_threads(env, config)
    log.info("data-parallel rank %d of %d%s", env.rank, env.world_size,
             f" ({threads} CPU threads)" if threads else "")
    return config, rank
