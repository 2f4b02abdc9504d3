"""The engine's telemetry publisher: a PUB socket driven by its own thread.

Why a thread of its own: the engine's busy loop must never wait on telemetry. The loop only
does O(1) hand-offs into the publisher's `Inbox` (`record_step` appends to a bounded deque and
adds the step to the cumulative totals the ``step`` topic carries, `submit_snapshot` replaces
one "latest" slot); this thread owns the PUB socket (zmq sockets are never shared across
threads) through a `Sender`, and its `PublishLoop` aggregates, encodes
(`vconsole.telemetry.schema`) and sends. Health heartbeats, gpu/host readings and
config announcements come from this thread's own clock, so they keep flowing while the engine
loop sleeps.

Invariants:

- The engine pays nothing for a slow or absent subscriber: sends are ``NOBLOCK`` on a PUB with
  ``sndhwm = zmq_sndhwm`` (PUB drops at the high-water mark instead of blocking); a send that
  still reports EAGAIN is counted in ``health.send_drops``. Subscribers count their own losses
  from the per-topic ``seq`` gaps.
- step/sched/kv go out at most ``telemetry_hz`` times a second (a fresh snapshot may follow the
  previous message by 85% of a period: the engine's `snapshot_due` already spaces snapshots).
  The send slots are phase-locked (the next is a period after the previous *slot*, not after
  a late send, and at least half a period after the send): otherwise one late send would hold
  every later snapshot back too (the console's lag, `bench console`).
  sched and kv are *state*: when the engine submits nothing new (idle), the last snapshot is
  re-sent every heartbeat so a late subscriber still learns it (``snapshot_ts`` tells its age);
  step then reports an empty window.
- Objects handed to `submit_snapshot` belong to the publisher afterwards: the engine must not
  mutate them (in particular ``KVStats.block_states``, which is sent without a copy).

Where the thread runs: in this process (the default, and a CURVE engine's: its keys and ZAP
handler live in the engine's context), or with ``process=True`` in a child process
(`publisher_process`: the engine process keeps only the hand-off, through a `ChildLink` with
the same engine-thread methods as the `Inbox`, and ``/metrics`` moves there too). The engine
process runs it in a child (`vconsole.engine.process.telemetry_outlets`): a second Python
thread in the engine process costs the busy loop the GIL whenever torch gives it up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from vconsole.engine.latency import LatencyBatch
from vconsole.engine.publish.bodies import KVFormat
from vconsole.engine.publish.host import HostProbe
from vconsole.engine.publish.inbox import Inbox
from vconsole.engine.publish.publish_loop import LoopStart, Probe, PublishLoop
from vconsole.engine.publish.publisher_process import ChildLink, ChildSpec
from vconsole.engine.publish.request_text import TokenLists
from vconsole.engine.publish.sender import Sender
from vconsole.shared.config import EngineConfig, describe_config
from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats
from vconsole.telemetry import schema
from vconsole.telemetry.alerts import restart_event
from vconsole.telemetry.gpu import GpuProbe
from vconsole.telemetry.request_text import turns_on

log = logging.getLogger(__name__)

LOOP_RETRY_S = 1.0            # after this thread's own loop raised, it starts over after this


class Handover(Protocol):
    """The engine thread's side of the hand-off: an `Inbox` (this process's publisher thread)
    or a `ChildLink` (a publisher process)."""

    config: EngineConfig
    steps_recorded: int

    @property
    def engine_errors(self) -> int: ...
    def record_step(self, stats: StepStats) -> None: ...
    def snapshot_due(self) -> bool: ...
    def submit_snapshot(self, sched: SchedulerStats, kv: KVStats, state: str,
                        num_steps: int, text: list[TokenLists] | None = None) -> None: ...
    def submit_latency(self, batch: LatencyBatch) -> None: ...
    def submit_dp(self, body: dict[str, Any]) -> None: ...
    def submit_kv_residency(self, samples: list[ResidencySample]) -> None: ...
    def submit_wave(self, body: dict[str, Any]) -> None: ...
    def report_error(self, part: str, message: str) -> None: ...
    def set_state(self, state: str) -> None: ...
    def publish_config(self, version: int, values: dict[str, Any]) -> None: ...
    def update_config(self, config: EngineConfig) -> None: ...


class TelemetryPublisher:
    """Publishes one engine's telemetry on ``endpoint`` (bound by `start`).

    Engine-thread methods (cheap, never block on I/O): `record_step`, `snapshot_due`,
    `submit_snapshot`, `set_state`, `publish_config`, `update_config`, and on a data-parallel
    rank `submit_dp` and `submit_wave`: each hands over to `inbox`. ``gpu_probe`` and
    ``host_probe`` replace the real probes (tests); ``secure(sock)`` sets the PUB socket's
    security options (the engine's CURVE keys) before it binds; ``restart_count`` and
    ``restart_reason`` are what the supervisor told this engine process (`health_body`).
    ``detokenize`` (the core's) makes request text when ``publish_request_text`` is on;
    ``text_refusal`` says why this socket may never carry it
    (`vconsole.security.bind_policy.request_text_refusal`): then none is sent, whatever the
    config says. ``kv_format`` (the pool's dtype and bytes per token) goes into every ``kv``
    body; None leaves those fields null. ``announce_restart``: the first loop sends the
    supervisor's restart as an ``alert`` event (not again by a restarted publisher process).

    ``process=True`` runs the thread in a child process (see the module docstring; not with
    ``secure``): ``metrics`` (host, port) starts ``/metrics`` there too (`metrics_url` once
    started), labelled with ``model_name``; `sent` and `send_drops` are the child's, known
    once it closed, and `last_bodies` is empty here."""

    def __init__(self, ctx: zmq.Context, endpoint: str, engine_id: str, rank: int,
                 config: EngineConfig, *, gpu_probe: Probe | None = None,
                 host_probe: Probe | None = None,
                 secure: Callable[[zmq.Socket], None] | None = None,
                 restart_count: int = 0, restart_reason: str | None = None,
                 detokenize: Callable[[list[int]], str] | None = None,
                 text_refusal: str | None = None, kv_format: KVFormat | None = None,
                 announce_restart: bool = True, process: bool = False,
                 metrics: tuple[str, int] | None = None, model_name: str = "") -> None:
        if process and secure is not None:
            raise ValueError("a CURVE publisher runs in the engine process (its keys and ZAP "
                             "handler are the engine context's)")
        self._ctx = ctx
        self.announce_restart = announce_restart
        self.kv_format = kv_format
        self.detokenize = detokenize
        self.text_refusal = text_refusal
        self.restart_count = restart_count      # from the supervisor: in every health message
        self.restart_reason = restart_reason
        self._secure = secure         # called on the PUB socket before it binds (CURVE keys)
        self.endpoint = endpoint      # after start(): the bound address (resolves tcp://...:*)
        self.engine_id = engine_id
        self.rank = rank
        self._gpu_probe = gpu_probe
        self._host_probe = host_probe
        self.inbox = Inbox(config)
        dims = kv_format.dims if kv_format is not None else None
        if config.enable_mfu_metrics and dims is not None:
            self.inbox.measure_perf(dims)
        self._sender: Sender | None = None       # once bound (publisher thread)
        self.loop_errors = 0                      # this thread's own loop failures
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self.error: BaseException | None = None  # set if the thread died
        self.config_schema = describe_config()
        self.t0_wall = time.time()
        self.t0 = time.monotonic()
        self.pid = os.getpid()             # the engine process, named in health
        self.text_decoded = False          # request text arrives decoded (a publisher process)
        self.child: ChildLink | None = None
        if process:
            self.child = ChildLink(ctx, ChildSpec(
                handoff="", answers="", parent_pid=self.pid, endpoint=endpoint, engine_id=engine_id,
                rank=rank, config=config, announced=self.inbox.announced, state="idle",
                steps_recorded=0, engine_errors=0, restart_count=restart_count,
                restart_reason=restart_reason, kv_format=kv_format, t0=self.t0,
                t0_wall=self.t0_wall, pid=self.pid, metrics=metrics, model_name=model_name,
                text_decoded=True), detokenize=detokenize if text_refusal is None else None)
        self._to: Handover = self.child if self.child is not None else self.inbox
        # The two calls of every step go straight to the hand-off (one call frame less each).
        self.record_step = self._to.record_step      # type: ignore[method-assign]
        self.snapshot_due = self._to.snapshot_due    # type: ignore[method-assign]

    # --- engine thread: hand-offs to the inbox -------------------------------------------------

    def record_step(self, stats: StepStats) -> None:
        """O(1): buffer one step's stats for the next ``step`` window and add it to the
        cumulative totals."""
        self._to.record_step(stats)

    def snapshot_due(self) -> bool:
        """True at most ``telemetry_hz`` times a second: time to build and submit a snapshot."""
        return self._to.snapshot_due()

    def submit_snapshot(self, sched: SchedulerStats, kv: KVStats, state: str,
                        num_steps: int, text: list[TokenLists] | None = None) -> None:
        """Hand over the latest scheduler and KV state (and its rows' request text, as token
        ids: `wants_text`); replaces any not yet sent."""
        self._to.submit_snapshot(sched, kv, state, num_steps, text)

    @property
    def mirrors_queue(self) -> bool:
        """Whether snapshots leave the waiting rows to the publisher process's mirror of the
        queue (`vconsole.engine.publish.queue_mirror`): a publisher process does."""
        return self.child is not None

    def refuses_text(self, values: dict[str, Any]) -> str | None:
        """Why a config change that turns request text on is refused here (`text_refusal`),
        or None (nothing refused, or the change does not turn it on)."""
        return self.text_refusal if turns_on(values) else None

    def wants_text(self) -> bool:
        """Whether the next snapshot should bring its rows' token ids for request text."""
        return (self._to.config.publish_request_text and self.text_refusal is None
                and self.detokenize is not None)

    def submit_latency(self, batch: LatencyBatch) -> None:
        """Hand over the latency observations since the last batch (`LatencyLog.drain`): the
        publisher folds them into its histograms and windows and sends the ``latency`` body at
        once."""
        self._to.submit_latency(batch)

    def submit_kv_residency(self, samples: list[ResidencySample]) -> None:
        self._to.submit_kv_residency(samples)

    def submit_dp(self, body: dict[str, Any]) -> None:
        """Hand over a data-parallel rank's ``dp`` body (at the snapshot rate); sent at once,
        then repeated every heartbeat while nothing newer comes (an idle rank submits none)."""
        self._to.submit_dp(body)

    def submit_wave(self, body: dict[str, Any]) -> None:
        """Queue a ``wave`` event (a wave started or completed on this rank); sent at once,
        in order, each once."""
        self._to.submit_wave(body)

    def report_error(self, part: str, message: str) -> None:
        """A telemetry failure the busy loop survived (`vconsole.engine.telemetry_guard`):
        counted in ``health.telemetry_errors`` and raised as a ``telemetry_error`` alert (at
        most one per part every `ERROR_ALERT_EVERY_S`)."""
        self._to.report_error(part, message)

    def set_state(self, state: str) -> None:
        """Announce idle/running/draining without a snapshot (shows in the next health)."""
        self._to.set_state(state)

    def publish_config(self, version: int, values: dict[str, Any]) -> None:
        """Announce the effective config now (and then every ``config_interval_s``)."""
        self._to.publish_config(version, values)

    def update_config(self, config: EngineConfig) -> None:
        """Take new hot telemetry and alert settings (rates, row cap, thresholds)."""
        self._to.update_config(config)

    # --- what was sent ----------------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self._to.config

    @property
    def steps_recorded(self) -> int:
        return self._to.steps_recorded

    @property
    def telemetry_errors(self) -> int:
        return self._to.engine_errors + self.loop_errors

    @property
    def sent(self) -> dict[str, int]:
        """Messages sent per topic (none before the socket is bound; a publisher process's
        once it closed)."""
        if self.child is not None:
            return {**dict.fromkeys(schema.TOPICS, 0), **self.child.sent}
        return self._sender.sent if self._sender else dict.fromkeys(schema.TOPICS, 0)

    @property
    def send_drops(self) -> int:
        if self.child is not None:
            return self.child.send_drops
        return self._sender.send_drops if self._sender else 0

    @property
    def metrics_url(self) -> str | None:
        """A publisher process's ``/metrics`` URL (port 0 resolved), once started."""
        return self.child.metrics_url if self.child is not None else None

    @property
    def encode_errors(self) -> int:
        return self._sender.encode_errors if self._sender else 0

    def last_bodies(self) -> dict[str, dict[str, Any]]:
        """The last message sent on each topic (envelope included): what a subscriber saw
        last. Read by exporters (Prometheus) so their figures equal the stream's."""
        return self._sender.last_bodies() if self._sender else {}

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread and bind; raises here (e.g. address in use) if binding fails."""
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        if self.child is not None:
            self.child.start()
            self.endpoint = self.child.endpoint
            self._thread = threading.Thread()    # started: a second start raises
            return
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{self.engine_id}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def close(self, timeout: float = 5.0) -> None:
        if self.child is not None:
            self.child.close(timeout)
            return
        self._stop.set()
        self.inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the publisher thread (or process) still runs (e.g. after a `close` that
        timed out)."""
        if self.child is not None:
            return self.child.is_alive()
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> TelemetryPublisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publisher thread ----------------------------------------------------------------------

    def _open(self) -> zmq.Socket:
        config = self.inbox.config
        sock = self._ctx.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.SNDHWM, config.zmq_sndhwm)
            sock.setsockopt(zmq.LINGER, config.zmq_linger_ms)
            if self._secure is not None:
                self._secure(sock)
            sock.bind(self.endpoint)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _loop_start(self) -> LoopStart:
        """What the next loop starts from (a loop that failed left the rest in the inbox)."""
        inbox = self.inbox
        return LoopStart(config=inbox.config, announced=inbox.announced,
                         config_schema=self.config_schema,
                         steps_recorded=inbox.steps_recorded, t0=self.t0, t0_wall=self.t0_wall,
                         restart_count=self.restart_count, restart_reason=self.restart_reason,
                         loop_errors=self.loop_errors, detokenize=self.detokenize,
                         text_refusal=self.text_refusal, kv_format=self.kv_format,
                         pid=self.pid, text_decoded=self.text_decoded)

    def _run(self) -> None:
        try:
            sock = self._open()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        sender = self._sender = Sender(sock, self.engine_id, self.rank)
        self._ready.set()
        gpu = self._gpu_probe if self._gpu_probe is not None else GpuProbe()
        host = self._host_probe if self._host_probe is not None else HostProbe()
        try:
            if self.restart_count and self.announce_restart:   # an event, not only a state
                sender.send("alert", restart_event(
                    self.restart_count, self.restart_reason, back=True).payload())
            while not self._stop.is_set():
                try:
                    PublishLoop(self.inbox, sender, gpu, host, time.monotonic,
                                self._loop_start()).run(self._stop.is_set, self.inbox.wait)
                except Exception as e:  # start over with fresh state; the engine is untouched
                    self.error = e
                    self.loop_errors += 1
                    if self.loop_errors == 1:
                        log.exception("telemetry publisher loop failed; it starts over "
                                      "(later failures are counted in health.telemetry_errors)")
                    self._stop.wait(LOOP_RETRY_S)
        finally:
            sock.close(self.inbox.config.zmq_linger_ms)
            if self._gpu_probe is None and isinstance(gpu, GpuProbe):
                gpu.close()
