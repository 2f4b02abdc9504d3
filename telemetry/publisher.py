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
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol

import numpy as np
import zmq

from vconsole.engine.config import EngineConfig, describe_config
from vconsole.engine.stats import KVStats, RequestTable, SchedulerStats, StepStats
from vconsole.telemetry import schema
from vconsole.telemetry.alerts import (
    AlertEvaluator,
    AlertEvent,
    restart_event,
    telemetry_error_event,
)
from vconsole.telemetry.gpu import GpuProbe, memory_share
from vconsole.telemetry.host import HostProbe

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0        # gpu and host
ERROR_ALERT_EVERY_S = 30.0    # at most one telemetry_error alert per part this often
LOOP_RETRY_S = 1.0            # after this thread's own loop raised, it starts over after this
SNAPSHOT_EARLY = 0.15        # of a period: how early a fresh snapshot may follow the last
MAX_BUFFERED_STEPS = 1 << 16  # steps kept between two publish windows; older ones are counted
# Tokens per engine step: the ``step`` topic's ``iteration_tokens`` histogram (vLLM's bounds for
# ``vllm:iteration_tokens_total``).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ROW_GETTERS = {c: attrgetter(c) for c in schema.REQUEST_COLUMNS}


class _Probe(Protocol):
    def read(self) -> dict[str, Any]: ...


def request_columns(rows: Any) -> RequestTable | dict[str, list[Any]]:
    """The ``requests`` table to encode: a `RequestTable` (the scheduler's: numpy columns that
    `schema.encode` sends as raw buffers) goes as it is; RequestRow objects become column
    lists, without per-row dicts."""
    if isinstance(rows, RequestTable):
        return rows
    return {c: list(map(g, rows)) for c, g in _ROW_GETTERS.items()}


def aggregate_steps(steps: list[StepStats], window_s: float) -> dict[str, Any]:
    """The ``step`` topic body for one window of steps (empty window -> zeros)."""
    n = len(steps)
    sched_ns = sum(s.schedule_ns for s in steps)
    totals = np.fromiter((s.total_ns for s in steps), dtype=np.int64, count=n)
    total_ns = int(totals.sum()) if n else 0
    prefill = sum(s.num_prefill_tokens for s in steps)
    decode = sum(s.num_decode_tokens for s in steps)
    per_s = 1.0 / window_s if window_s > 0 else 0.0
    return {
        "steps": n,
        "window_s": window_s,
        "phase_s": {"schedule": sched_ns / 1e9,
                    "execute": sum(s.execute_ns for s in steps) / 1e9,
                    "update": sum(s.update_ns for s in steps) / 1e9},
        "busy_s": total_ns / 1e9,
        "step_time_p50_s": float(np.median(totals)) / 1e9 if n else 0.0,
        "step_time_max_s": int(totals.max()) / 1e9 if n else 0.0,
        "num_prefill_tokens": prefill,
        "num_decode_tokens": decode,
        "num_reqs_max": max((s.num_reqs for s in steps), default=0),
        "num_preempted": sum(s.num_preempted for s in steps),
        "num_finished": sum(s.num_finished for s in steps),
        "tokens_per_s": (prefill + decode) * per_s,
        "steps_per_s": n * per_s,
        "sched_share": sched_ns / total_ns if total_ns else 0.0,
    }


def health_body(state: str, *, uptime_s: float, steps: int, interval_s: float,
                started_ts: float, pid: int | None = None, send_drops: int = 0,
                steps_dropped: int = 0, alerts_active: dict[str, str] | None = None,
                last_step_age_s: float | None = None, restart_count: int = 0,
                restart_reason: str | None = None,
                telemetry_errors: int = 0) -> dict[str, Any]:
    """The ``health`` topic body: one place, so the engine's publisher and the supervisor's
    `vconsole.telemetry.beacon.HealthBeacon` send the same fields. ``restart_count`` and
    ``restart_reason``: how often the supervisor restarted this engine and why it did the last
    time (0 and None: never restarted, or not supervised). ``telemetry_errors``: telemetry
    failures this engine process survived (`vconsole.engine.telemetry_guard`, and this
    publisher's own loop)."""
    return {
        "state": state, "uptime_s": uptime_s, "steps": steps, "interval_s": interval_s,
        "pid": os.getpid() if pid is None else pid, "started_ts": started_ts,
        "send_drops": send_drops, "steps_dropped": steps_dropped,
        "alerts_active": {} if alerts_active is None else alerts_active,
        "last_step_age_s": last_step_age_s,
        "restart_count": restart_count, "restart_reason": restart_reason,
        "telemetry_errors": telemetry_errors,
    }


def sched_body(s: SchedulerStats, max_rows: int) -> dict[str, Any]:
    rows = s.requests
    truncated = s.requests_truncated or len(rows) > max_rows
    return {
        "num_waiting": s.num_waiting, "num_running": s.num_running,
        "num_preempted": s.num_preempted, "num_preemptions_total": s.num_preemptions_total,
        "num_finished_total": s.num_finished_total,
        "num_prompt_tokens_total": s.num_prompt_tokens_total,
        "num_generation_tokens_total": s.num_generation_tokens_total,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens, "policy": s.policy,
        "requests": request_columns(rows[:max_rows] if len(rows) > max_rows else rows),
        "requests_truncated": truncated,
    }


def kv_body(k: KVStats) -> dict[str, Any]:
    return {
        "num_blocks": k.num_blocks, "block_size": k.block_size, "num_free": k.num_free,
        "num_used": k.num_used, "num_cached": k.num_cached, "num_shared": k.num_shared,
        "usage": k.usage, "token_usage": k.token_usage, "fragmentation": k.fragmentation,
        "prefix_queries": k.prefix_queries, "prefix_hits": k.prefix_hits,
        "prefix_hit_rate": k.prefix_hit_rate,
        "block_states": np.asarray(k.block_states, dtype=np.uint8),
    }


class TelemetryPublisher:
    """Publishes one engine's telemetry on ``endpoint`` (bound by `start`).

    Engine-thread methods (cheap, never block on I/O): `record_step`, `snapshot_due`,
    `submit_snapshot`, `set_state`, `publish_config`, `update_config`, and on a data-parallel
    rank `submit_dp` and `submit_wave`. ``gpu_probe`` and
    ``host_probe`` replace the real probes (tests); ``secure(sock)`` sets the PUB socket's
    security options (the engine's CURVE keys) before it binds; ``restart_count`` and
    ``restart_reason`` are what the supervisor told this engine process (`health_body`)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, engine_id: str, rank: int,
                 config: EngineConfig, *, gpu_probe: _Probe | None = None,
                 host_probe: _Probe | None = None,
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
        self._steps_recorded = 0      # written by the engine thread only
        # Cumulative since start, every recorded step (none lost to the bounded deque): tokens
        # per step (per bucket, not cumulative) and their sum, phase ns. Guarded by _totals_lock
        # (held for a few additions or one copy), so one step is in all of them or in none.
        self._totals_lock = threading.Lock()
        self._iter_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iter_tokens = 0
        self._phase_ns = [0, 0, 0]    # schedule, execute, update
        self._last_step_t: float | None = None
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
        self._config_msg: tuple[int, dict[str, Any]] = (0, config.to_dict())
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
        self._config_schema = describe_config()
        self._steps_seen = 0          # steps drained from the deque (overflow = recorded - seen)
        self._t0_wall = time.time()
        self._t0 = time.monotonic()

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
        self._steps_recorded += 1
        self._last_step_t = time.monotonic()

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

    def _send(self, sock: zmq.Socket, topic: str, body: dict[str, Any]) -> None:
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
                self._send(sock, "alert", restart_event(
                    self.restart_count, self.restart_reason, back=True).payload())
            while not self._stop.is_set():
                try:
                    self._loop(sock, gpu, host)
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

    def _loop(self, sock: zmq.Socket, gpu: _Probe, host: _Probe) -> None:
        evaluator = AlertEvaluator(self._config)
        cfg = self._config
        now = time.monotonic()
        next_snap = now            # earliest time step/sched/kv may go out again
        last_window = now          # start of the current step window
        last_state_sent = -1e18    # when sched/kv last went out
        next_health = now
        next_probe = now
        next_config = now
        snapshot: tuple[SchedulerStats, KVStats, int, float] | None = None
        have_new = False
        latency_body: dict[str, Any] | None = None
        next_latency = now
        dp_body: dict[str, Any] | None = None
        next_dp = now
        next_error_alert: dict[str, float] = {}

        while not self._stop.is_set():
            with self._lock:
                if self._latest is not None:
                    snapshot, have_new = self._latest, True
                    self._latest = None
                new_cfg, self._pending_config = self._pending_config, None
                latency, self._latency = self._latency, None
                dp, self._dp = self._dp, None
                waves, self._waves = self._waves, []
                announce, self._announce = self._announce, None
                state = self._state
                errors, self._error_reports = self._error_reports, {}
            alerts: list[AlertEvent] = []
            if new_cfg is not None:
                cfg = new_cfg
                alerts += evaluator.update_config(cfg)
            now = time.monotonic()
            for part, message in errors.items():   # the others are counted, not alerted
                if now >= next_error_alert.get(part, 0.0):
                    alerts.append(telemetry_error_event(part, message, self.telemetry_errors))
                    next_error_alert[part] = now + ERROR_ALERT_EVERY_S
            if announce is not None:
                self._config_msg = announce
                next_config = now
            if now >= next_config:
                version, values = self._config_msg
                self._send(sock, "config", {"version": version, "values": values,
                                            "schema": self._config_schema})
                next_config = now + cfg.config_interval_s

            steps_waiting = bool(self._steps)
            refresh = snapshot is not None and now - last_state_sent >= cfg.heartbeat_interval_s
            # A fresh snapshot may go out a little early (the engine's `snapshot_due` already
            # spaces them 1/hz apart): otherwise the two 10 Hz clocks drift apart and each
            # snapshot waits up to a period here (the console's lag, `bench console`).
            early = SNAPSHOT_EARLY / cfg.telemetry_hz if have_new else 0.0
            if now >= next_snap - early and (have_new or steps_waiting or refresh):
                drained = self._drain_steps()
                step = aggregate_steps(drained, now - last_window)
                step.update(self._step_totals())
                last_window = now
                self._send(sock, "step", step)
                if drained:
                    alerts += evaluator.observe(step_time_s=step["step_time_p50_s"],
                                                sched_share=step["sched_share"])
                if snapshot is not None and (have_new or refresh):
                    sched, kv, _, snap_ts = snapshot
                    body = sched_body(sched, cfg.telemetry_max_requests)
                    body["snapshot_ts"] = snap_ts
                    self._send(sock, "sched", body)
                    body = kv_body(kv)
                    body["snapshot_ts"] = snap_ts
                    self._send(sock, "kv", body)
                    if have_new:
                        alerts += evaluator.observe(num_waiting=sched.num_waiting,
                                                    fragmentation=kv.fragmentation)
                    last_state_sent = now
                have_new = False
                period = 1.0 / cfg.telemetry_hz
                next_snap = max(next_snap + period, now + period / 2)   # phase-locked

            if latency is not None:
                latency_body = latency
            if latency_body is not None and (latency is not None or now >= next_latency):
                # An idle engine submits nothing: repeat the last body, so a late subscriber
                # (`vconsole top --once`) still hears the topic.
                self._send(sock, "latency", latency_body)
                next_latency = now + cfg.heartbeat_interval_s

            if state == "idle" and not self._steps:
                # Nothing to do is not slow. (A running engine with no steps may be stuck
                # inside one: it keeps its level, and health.last_step_age_s grows.)
                alerts += evaluator.observe(step_time_s=0.0, sched_share=0.0)

            for wave in waves:
                self._send(sock, "wave", wave)
            if dp is not None:
                dp_body = dp
            if dp_body is not None and (dp is not None or now >= next_dp):
                self._send(sock, "dp", dp_body)
                next_dp = now + cfg.heartbeat_interval_s

            if now >= next_probe:
                reading = gpu.read()
                self._send(sock, "gpu", reading)
                share = memory_share(reading) if reading.get("available") else None
                alerts += evaluator.observe(gpu_memory_share=share)
                self._send(sock, "host", host.read())
                next_probe = now + PROBE_INTERVAL_S

            for ev in alerts:
                self._send(sock, "alert", ev.payload())

            if now >= next_health:
                num_steps = max(self._steps_recorded, snapshot[2] if snapshot else 0)
                last_step = self._last_step_t
                self._send(sock, "health", health_body(
                    state, uptime_s=now - self._t0, steps=num_steps,
                    interval_s=cfg.heartbeat_interval_s, started_ts=self._t0_wall,
                    send_drops=self.send_drops,
                    steps_dropped=max(0, self._steps_recorded - self._steps_seen
                                      - len(self._steps)),
                    alerts_active=evaluator.active(),
                    last_step_age_s=None if last_step is None else max(0.0, now - last_step),
                    restart_count=self.restart_count, restart_reason=self.restart_reason,
                    telemetry_errors=self.telemetry_errors))
                next_health = now + cfg.heartbeat_interval_s

            deadlines = [next_health, next_probe, next_config]
            if latency_body is not None:
                deadlines.append(next_latency)
            if dp_body is not None:
                deadlines.append(next_dp)
            if have_new or self._steps or snapshot is not None:
                deadlines.append(next_snap - early if (have_new or self._steps)
                                 else max(next_snap, last_state_sent + cfg.heartbeat_interval_s))
            wait = min(deadlines) - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
            self._wake.clear()

    def _step_totals(self) -> dict[str, Any]:
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

    def _drain_steps(self) -> list[StepStats]:
        out = []
        pop = self._steps.popleft
        with contextlib.suppress(IndexError):
            while True:
                out.append(pop())
        self._steps_seen += len(out)
        return out
