"""The engine's telemetry publisher: a PUB socket driven by its own thread.

Why a thread of its own: the engine's busy loop must never wait on telemetry. The loop only
does O(1) hand-offs (`record_step` appends to a bounded deque and adds the step to the
cumulative totals the ``step`` topic carries, `submit_snapshot` replaces one "latest" slot); this thread owns the PUB socket (zmq sockets are never shared across threads),
aggregates, encodes (`vconsole.telemetry.schema`) and sends. Health heartbeats, gpu/host readings and
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
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from vconsole.engine.publish.host import HostProbe
from vconsole.engine.publish.publish_loop import Handoff, Probe, PublishLoop
from vconsole.shared.config import EngineConfig, describe_config
from vconsole.shared.stats import KVStats, SchedulerStats, StepStats
from vconsole.telemetry import schema
from vconsole.telemetry.alerts import restart_event
from vconsole.telemetry.gpu import GpuProbe

log = logging.getLogger(__name__)

LOOP_RETRY_S = 1.0            # after this thread's own loop raised, it starts over after this
MAX_BUFFERED_STEPS = 1 << 16  # steps kept between two publish windows; older ones are counted
# Tokens per engine step: the ``step`` topic's ``iteration_tokens`` histogram (vLLM's bounds for
# ``vllm:iteration_tokens_total``).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TelemetryPublisher:
    """Publishes one engine's telemetry on ``endpoint`` (bound by `start`).

    Engine-thread methods (cheap, never block on I/O): `record_step`, `snapshot_due`,
    `submit_snapshot`, `set_state`, `publish_config`, `update_config`, and on a data-parallel
    rank `submit_dp` and `submit_wave`. ``gpu_probe`` and
    ``host_probe`` replace the real probes (tests); ``secure(sock)`` sets the PUB socket's
    security options (the engine's CURVE keys) before it binds; ``restart_count`` and
    ``restart_reason`` are what the supervisor told this engine process (`health_body`)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, engine_id: str, rank: int,
                 config: EngineConfig, *, gpu_probe: Probe | None = None,
                 host_probe: Probe | None = None,
                 secure: Callable[[zmq.Socket], None] | None = None,
                 restart_count: int = 0, restart_reason: str | None = None) -> None:
        self._ctx = ctx
        self.restart_count = restart_count      # from the supervisor: in every health message
        self.restart_reason = restart_reason
        self._secure = secure         # called on the PUB socket before it binds (CURVE keys)
        self.endpoint = endpoint      # after start(): the bound address (resolves tcp://...:*)
        self.engine_id = engine_id
        self.rank = rank
        self._config = config
        self._gpu_probe = gpu_probe
        self._host_probe = host_probe

        self._steps: deque[StepStats] = deque(maxlen=MAX_BUFFERED_STEPS)
        self.steps_recorded = 0      # written by the engine thread only
        # Cumulative since start, every recorded step (none lost to the bounded deque): tokens
        # per step (per bucket, not cumulative) and their sum, phase ns. Guarded by _totals_lock
        # (held for a few additions or one copy), so one step is in all of them or in none.
        self._totals_lock = threading.Lock()
        self._iter_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iter_tokens = 0
        self._phase_ns = [0, 0, 0]    # schedule, execute, update
        self.last_step_t: float | None = None
        self._next_due = 0.0          # engine thread only (snapshot_due)
        self._lock = threading.Lock()  # guards the hand-off slots below
        self._latest: tuple[SchedulerStats, KVStats, int, float] | None = None
        self._latency: dict[str, Any] | None = None   # the next ``latency`` body to send
        self._dp: dict[str, Any] | None = None        # the next ``dp`` body (DP ranks only)
        self._waves: list[dict[str, Any]] = []        # ``wave`` events not yet sent
        self._engine_errors = 0                       # `report_error` calls (engine thread)
        self._error_reports: dict[str, str] = {}      # part -> last message, not yet alerted
        self.loop_errors = 0                          # this thread's own loop failures
        self._state = "idle"
        self._pending_config: EngineConfig | None = None
        self._announce: tuple[int, dict[str, Any]] | None = None
        self.config_msg: tuple[int, dict[str, Any]] = (0, config.to_dict())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self.error: BaseException | None = None  # set if the thread died

        # Publisher-thread state.
        self._seq: dict[str, int] = dict.fromkeys(schema.TOPICS, 0)
        self._last_bodies: dict[str, dict[str, Any]] = {}
        self.sent: dict[str, int] = dict.fromkeys(schema.TOPICS, 0)
        self.send_drops = 0
        self.encode_errors = 0
        self.config_schema = describe_config()
        self._steps_seen = 0          # steps drained from the deque (overflow = recorded - seen)
        self.t0_wall = time.time()
        self.t0 = time.monotonic()

    # --- engine thread ----------------------------------------------------------------------

    def record_step(self, stats: StepStats) -> None:
        """O(1): buffer one step's stats for the next ``step`` window and add it to the
        cumulative totals."""
        tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        bucket = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)  # bounds are inclusive
        with self._totals_lock:
            self._iter_buckets[bucket] += 1
            self._iter_tokens += tokens
            phase = self._phase_ns
            phase[0] += stats.schedule_ns
            phase[1] += stats.execute_ns
            phase[2] += stats.update_ns
        self._steps.append(stats)
        self.steps_recorded += 1
        self.last_step_t = time.monotonic()

    def snapshot_due(self) -> bool:
        """True at most ``telemetry_hz`` times a second: time to build and submit a snapshot."""
        now = time.monotonic()
        if now < self._next_due:
            return False
        self._next_due = now + 1.0 / self._config.telemetry_hz
        return True

    def submit_snapshot(self, sched: SchedulerStats, kv: KVStats, state: str,
                        num_steps: int) -> None:
        """Hand over the latest scheduler and KV state; replaces any not yet sent."""
        with self._lock:
            self._latest = (sched, kv, num_steps, time.time())
            self._state = state
        self._wake.set()

    def submit_latency(self, body: dict[str, Any]) -> None:
        """Hand over a ``latency`` body (`vconsole.engine.latency`); sent at once."""
        with self._lock:
            self._latency = body
        self._wake.set()

    def submit_dp(self, body: dict[str, Any]) -> None:
        """Hand over a data-parallel rank's ``dp`` body (at the snapshot rate); sent at once,
        then repeated every heartbeat while nothing newer comes (an idle rank submits none)."""
        with self._lock:
            self._dp = body
        self._wake.set()

    def submit_wave(self, body: dict[str, Any]) -> None:
        """Queue a ``wave`` event (a wave started or completed on this rank); sent at once,
        in order, each once."""
        with self._lock:
            self._waves.append(body)
        self._wake.set()

    def report_error(self, part: str, message: str) -> None:
        """A telemetry failure the busy loop survived (`vconsole.engine.telemetry_guard`):
        counted in ``health.telemetry_errors`` and raised as a ``telemetry_error`` alert (at
        most one per part every `ERROR_ALERT_EVERY_S`)."""
        with self._lock:
            self._engine_errors += 1
            self._error_reports[part] = message
        self._wake.set()

    @property
    def telemetry_errors(self) -> int:
        return self._engine_errors + self.loop_errors

    def last_bodies(self) -> dict[str, dict[str, Any]]:
        """The last message sent on each topic (envelope included): what a subscriber saw
        last. Read by exporters (Prometheus) so their figures equal the stream's."""
        with self._lock:
            return dict(self._last_bodies)

    def set_state(self, state: str) -> None:
        """Announce idle/running/draining without a snapshot (shows in the next health)."""
        with self._lock:
            self._state = state

    def publish_config(self, version: int, values: dict[str, Any]) -> None:
        """Announce the effective config now (and then every ``config_interval_s``)."""
        with self._lock:
            self._announce = (version, dict(values))
        self._wake.set()

    def update_config(self, config: EngineConfig) -> None:
        """Take new hot telemetry and alert settings (rates, row cap, thresholds)."""
        self._config = config  # read by snapshot_due on the engine thread
        with self._lock:
            self._pending_config = config
        self._wake.set()

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread and bind; raises here (e.g. address in use) if binding fails."""
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{self.engine_id}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the publisher thread still runs (e.g. after a `close` that timed out)."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> TelemetryPublisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publisher thread ----------------------------------------------------------------------

    def send(self, sock: zmq.Socket, topic: str, body: dict[str, Any]) -> None:
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        payload = {**schema.make_envelope(self.engine_id, self.rank, seq, time.time()), **body}
        try:
            frames = schema.encode(topic, payload)
        except schema.SchemaError:
            self.encode_errors += 1
            log.exception("telemetry: cannot encode a %s message", topic)
            return
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.sent[topic] += 1
        except zmq.Again:
            self.send_drops += 1
        with self._lock:
            self._last_bodies[topic] = payload

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.SNDHWM, self._config.zmq_sndhwm)
            sock.setsockopt(zmq.LINGER, self._config.zmq_linger_ms)
            if self._secure is not None:
                self._secure(sock)
            sock.bind(self.endpoint)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _run(self) -> None:
        try:
            sock = self._open()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        gpu = self._gpu_probe if self._gpu_probe is not None else GpuProbe()
        host = self._host_probe if self._host_probe is not None else HostProbe()
        try:
            if self.restart_count:      # the restart is an event, not only a health state
                self.send(sock, "alert", restart_event(
                    self.restart_count, self.restart_reason, back=True).payload())
            while not self._stop.is_set():
                try:
                    PublishLoop(self, sock, gpu, host, time.monotonic).run(
                        self._stop.is_set, self._sleep)
                except Exception as e:  # start over with fresh state; the engine is untouched
                    self.error = e
                    self.loop_errors += 1
                    if self.loop_errors == 1:
                        log.exception("telemetry publisher loop failed; it starts over "
                                      "(later failures are counted in health.telemetry_errors)")
                    self._stop.wait(LOOP_RETRY_S)
        finally:
            sock.close(self._config.zmq_linger_ms)
            if self._gpu_probe is None and isinstance(gpu, GpuProbe):
                gpu.close()

    @property
    def config(self) -> EngineConfig:
        return self._config

    def take_handoff(self) -> Handoff:
        """Everything the engine thread handed over since the last call, at once."""
        with self._lock:
            h = Handoff(snapshot=self._latest, config=self._pending_config,
                        latency=self._latency, dp=self._dp, waves=self._waves,
                        announce=self._announce, state=self._state,
                        errors=self._error_reports)
            self._latest = self._pending_config = self._latency = self._dp = None
            self._announce = None
            self._waves, self._error_reports = [], {}
        return h

    def steps_pending(self) -> bool:
        return bool(self._steps)

    def steps_dropped(self) -> int:
        """Steps lost to the bounded deque before this thread drained them."""
        return max(0, self.steps_recorded - self._steps_seen - len(self._steps))

    def _sleep(self, seconds: float) -> None:
        """Until ``seconds`` pass or the engine thread wakes this one."""
        self._wake.wait(seconds)
        self._wake.clear()

    def step_totals(self) -> dict[str, Any]:
        """The ``step`` topic's cumulative fields: ``iteration_tokens`` (a histogram as the
        ``latency`` topic's: bounds with +Inf, cumulative counts, count, sum) and
        ``phase_s_total``."""
        with self._totals_lock:
            buckets = self._iter_buckets.copy()
            tokens = self._iter_tokens
            schedule, execute, update = self._phase_ns
        counts = list(itertools.accumulate(buckets))
        return {
            "iteration_tokens": {"bounds": [*ITERATION_TOKENS_BUCKETS, math.inf],
                                 "counts": counts, "count": counts[-1], "sum": tokens},
            "phase_s_total": {"schedule": schedule / 1e9, "execute": execute / 1e9,
                              "update": update / 1e9},
        }

    def drain_steps(self) -> list[StepStats]:
        out = []
        pop = self._steps.popleft
        with contextlib.suppress(IndexError):
            while True:
                out.append(pop())
        self._steps_seen += len(out)
        return out
