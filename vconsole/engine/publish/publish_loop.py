"""The publisher thread's loop: what goes out when.

Each pass takes what the engine thread handed over (`Handoff`), then walks one table of
cadences — a topic, how often it goes out (from the config, so hot changes apply at once) and
whether it has anything to send — and sends each one that is due; then it sleeps until the
earliest next one, or until the engine wakes it. Fresh data makes its cadence due at once (a
config announcement, a latency or dp body); an idle engine's last body is repeated every period
so a late subscriber still hears the topic.

The one slot outside the table is the snapshot (``step``, ``sched``, ``kv``): it goes out at
most ``telemetry_hz`` times a second, phase-locked (the next slot is a period after the previous
*slot*, at least half a period after the send) and a little early for a fresh snapshot
(`SNAPSHOT_EARLY`), so the engine's and this thread's 10 Hz clocks do not drift apart; with
nothing new it re-sends the last state every heartbeat.

With ``publish_request_text`` on (and the socket allowed to carry it: ``text_refusal`` None),
each fresh snapshot's request text is decoded here, on this thread (`request_text.TextBook`),
and every ``sched`` message carries it (`vconsole.telemetry.request_text`); a heartbeat re-send
carries the same text, a config that turned it off stops it at once.

Alerts raised while a pass runs (a threshold crossed by a step window, a snapshot or a GPU
reading, a telemetry failure the engine reported) go out right after the cadence that raised
them, and before the pass's heartbeat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vconsole.engine.publish.bodies import (
    KVFormat,
    aggregate_steps,
    health_body,
    kv_body,
    sched_body,
)
from vconsole.engine.publish.inbox import Handoff, Inbox, Snapshot, Text
from vconsole.engine.publish.request_text import TextBook
from vconsole.engine.publish.sender import Sender
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.alerts import AlertEvaluator, AlertEvent, telemetry_error_event
from vconsole.telemetry.gpu import memory_share
from vconsole.telemetry.request_text import FIELD as TEXT_FIELD

PROBE_INTERVAL_S = 1.0        # gpu and host
ERROR_ALERT_EVERY_S = 30.0    # at most one telemetry_error alert per part this often
SNAPSHOT_EARLY = 0.15         # of a period: how early a fresh snapshot may follow the last

class Probe(Protocol):
    def read(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class LoopStart:
    """What a loop starts from, fixed for its life: the config and its announcement in force,
    the config table's descriptions, the step count so far, when the publisher started, what
    the supervisor said of this process, and the loops that failed before this one."""

    config: EngineConfig
    announced: tuple[int, dict[str, Any]]
    config_schema: list[dict[str, Any]]
    steps_recorded: int
    t0: float                  # monotonic
    t0_wall: float
    restart_count: int = 0
    restart_reason: str | None = None
    loop_errors: int = 0
    detokenize: Callable[[list[int]], str] | None = None   # request text; None: never any
    text_refusal: str | None = None     # why this socket may not carry request text
    kv_format: KVFormat | None = None   # the pool's storage, in every kv body; None: unknown
    pid: int | None = None              # the engine process (health); None: this one
    text_decoded: bool = False          # request text arrives decoded (a publisher process)


@dataclass
class Cadence:
    """One topic on its own clock: sent when ``due`` and ``ready()``, then due again
    ``period(config)`` later."""

    topic: str
    period: Callable[[EngineConfig], float]
    send: Callable[[float], list[AlertEvent]]
    ready: Callable[[], bool] = lambda: True
    due: float = 0.0


def _heartbeat(cfg: EngineConfig) -> float:
    return cfg.heartbeat_interval_s


class PublishLoop:
    """One run of the publisher thread's loop (`TelemetryPublisher` starts a fresh one if a
    pass raises): it takes each `Handoff` from ``inbox`` and sends through ``sender``.
    ``clock`` is the publisher's monotonic clock."""

    def __init__(self, inbox: Inbox, sender: Sender, gpu: Probe, host: Probe,
                 clock: Callable[[], float], start: LoopStart) -> None:
        self.inbox, self.sender, self.gpu, self.host, self.clock = inbox, sender, gpu, host, clock
        self.start = start
        self.cfg = start.config
        self.config_msg = start.announced
        self.evaluator = AlertEvaluator(self.cfg)
        now = clock()
        self.state = "idle"
        self.last_handoff = Handoff(steps_recorded=start.steps_recorded, engine_errors=0)
        # The snapshot slot.
        self.snapshot: Snapshot | None = None
        self.text_lists: Text | None = None    # the snapshot's, when published
        self.text_body: dict[str, list[str]] | None = None  # ...and decoded
        self.text_book = TextBook(start.detokenize) if start.detokenize is not None else None
        self.have_new = False
        self.next_snap = now             # earliest time step/sched/kv may go out again
        self.last_window = now           # start of the current step window
        self.last_state_sent = -1e18     # when sched/kv last went out
        # Bodies repeated by their cadence while nothing newer comes.
        self.latency_body: dict[str, Any] | None = None
        self.dp_body: dict[str, Any] | None = None
        self.next_error_alert: dict[str, float] = {}
        self.health_steps = start.steps_recorded   # steps the last health message counted
        self.cadences = [
            Cadence("config", lambda c: c.config_interval_s, self._send_config, due=now),
            Cadence("latency", _heartbeat, self._send_latency,
                    ready=lambda: self.latency_body is not None, due=now),
            Cadence("dp", _heartbeat, self._send_dp,
                    ready=lambda: self.dp_body is not None, due=now),
            Cadence("gpu+host", lambda c: PROBE_INTERVAL_S, self._send_probes, due=now),
            Cadence("health", _heartbeat, self._send_health, due=now),
        ]
        self._by_topic = {c.topic: c for c in self.cadences}

    def run(self, stopped: Callable[[], bool], wait: Callable[[float], None]) -> None:
        while not stopped():
            self.pass_once(self.inbox.take())
            delay = self.next_deadline() - self.clock()
            if delay > 0:
                wait(delay)

    def pass_once(self, handoff: Handoff) -> None:
        now = self.clock()
        self._send_alerts(self._absorb(handoff, now))
        self._send_alerts(self._snapshot_slot(now))
        if self.state == "idle" and not self.inbox.steps_pending():
            # Nothing to do is not slow. (A running engine with no steps may be stuck inside
            # one: it keeps its level, and health.last_step_age_s grows.)
            self._send_alerts(self.evaluator.observe_steps(now, 0.0, 0)
                              + self.evaluator.observe(sched_share=0.0))
        for cadence in self.cadences:
            if cadence.ready() and now >= cadence.due:
                self._send_alerts(cadence.send(now))
                cadence.due = now + cadence.period(self.cfg)

    def next_deadline(self) -> float:
        deadlines = [c.due for c in self.cadences if c.ready()]
        if self.have_new or self.inbox.steps_pending():
            deadlines.append(self.next_snap - self._early())
        elif self.snapshot is not None:
            deadlines.append(max(self.next_snap,
                                 self.last_state_sent + self.cfg.heartbeat_interval_s))
        return min(deadlines)

    @property
    def telemetry_errors(self) -> int:
        """The engine's reported failures and the publisher loops that failed before this."""
        return self.last_handoff.engine_errors + self.start.loop_errors

    # --- a pass ---------------------------------------------------------------------------------

    def _absorb(self, h: Handoff, now: float) -> list[AlertEvent]:
        """Take the hand-off: fresh data makes its cadence due now."""
        alerts: list[AlertEvent] = []
        self.last_handoff = h
        self.state = h.state
        if h.snapshot is not None:
            self.snapshot, self.text_lists, self.have_new = h.snapshot, h.text, True
        if h.config is not None:
            self.cfg = h.config
            alerts += self.evaluator.update_config(h.config)
        for part, message in h.errors.items():    # the others are counted, not alerted
            if now >= self.next_error_alert.get(part, 0.0):
                alerts.append(telemetry_error_event(part, message, self.telemetry_errors))
                self.next_error_alert[part] = now + ERROR_ALERT_EVERY_S
        if h.announce is not None:
            self.config_msg = h.announce
            self._by_topic["config"].due = now
        if h.latency is not None:
            self.latency_body = h.latency
            self._by_topic["latency"].due = now
        if h.dp is not None:
            self.dp_body = h.dp
            self._by_topic["dp"].due = now
        for wave in h.waves:
            self.sender.send("wave", wave)
        return alerts

    def _early(self) -> float:
        return SNAPSHOT_EARLY / self.cfg.telemetry_hz if self.have_new else 0.0

    def _snapshot_slot(self, now: float) -> list[AlertEvent]:
        """``step`` (the window since the last one), then ``sched`` and ``kv`` when there is a
        new snapshot or the last one is a heartbeat old."""
        cfg = self.cfg
        alerts: list[AlertEvent] = []
        refresh = (self.snapshot is not None
                   and now - self.last_state_sent >= cfg.heartbeat_interval_s)
        if now < self.next_snap - self._early() or not (
                self.have_new or self.inbox.steps_pending() or refresh):
            return alerts
        window = self.inbox.drain_window()
        drained = window.steps
        step = aggregate_steps(drained, now - self.last_window)
        step.update(window.totals)
        self.last_window = now
        self.sender.send("step", step)
        if drained:
            alerts += self.evaluator.observe_steps(now, step["step_time_p50_s"], len(drained))
            alerts += self.evaluator.observe(sched_share=step["sched_share"])
        if self.snapshot is not None and (self.have_new or refresh):
            sched, kv, _, snap_ts = self.snapshot
            body = {**sched_body(sched, cfg.telemetry_max_requests), "snapshot_ts": snap_ts}
            if self.have_new:
                self.text_body = self._request_text()
            if self.text_body is not None and self.text_allowed():
                body[TEXT_FIELD] = self.text_body
            self.sender.send("sched", body)
            self.sender.send("kv", {**kv_body(kv, self.start.kv_format),
                                    "snapshot_ts": snap_ts})
            if self.have_new:
                alerts += self.evaluator.observe(num_waiting=sched.num_waiting,
                                                 fragmentation=kv.fragmentation)
            self.last_state_sent = now
        self.have_new = False
        period = 1.0 / cfg.telemetry_hz
        self.next_snap = max(self.next_snap + period, now + period / 2)   # phase-locked
        return alerts

    def text_allowed(self) -> bool:
        """Request text goes out: asked for, allowed on this socket, and decodable."""
        return (self.cfg.publish_request_text and self.start.text_refusal is None
                and (self.text_book is not None or self.start.text_decoded))

    def _request_text(self) -> dict[str, list[str]] | None:
        if not self.text_allowed() or self.text_lists is None:
            return None
        if isinstance(self.text_lists, dict):      # decoded in the engine process
            return self.text_lists
        assert self.text_book is not None
        return self.text_book.body(self.text_lists)

    def _send_alerts(self, alerts: list[AlertEvent]) -> None:
        for ev in alerts:
            self.sender.send("alert", ev.payload())

    # --- the cadences ---------------------------------------------------------------------------

    def _send_config(self, now: float) -> list[AlertEvent]:
        version, values = self.config_msg
        self.sender.send("config", {"version": version, "values": values,
                                    "schema": self.start.config_schema})
        return []

    def _send_latency(self, now: float) -> list[AlertEvent]:
        assert self.latency_body is not None
        self.sender.send("latency", self.latency_body)
        return []

    def _send_dp(self, now: float) -> list[AlertEvent]:
        assert self.dp_body is not None
        self.sender.send("dp", self.dp_body)
        return []

    def _send_probes(self, now: float) -> list[AlertEvent]:
        reading = self.gpu.read()
        self.sender.send("gpu", reading)
        share = memory_share(reading) if reading.get("available") else None
        self.sender.send("host", self.host.read())
        return self.evaluator.observe(gpu_memory_share=share)

    def _send_health(self, now: float) -> list[AlertEvent]:
        h, start = self.last_handoff, self.start
        num_steps = max(h.steps_recorded, self.snapshot[2] if self.snapshot else 0)
        last_step = h.last_step_t
        # An engine that stepped since the last heartbeat is running, even if this instant
        # finds it between two requests (under light load it is idle most instants).
        state = "running" if self.state == "idle" and num_steps > self.health_steps \
            else self.state
        self.health_steps = num_steps
        self.sender.send("health", health_body(
            state, uptime_s=now - start.t0, steps=num_steps, pid=start.pid,
            interval_s=self.cfg.heartbeat_interval_s, started_ts=start.t0_wall,
            send_drops=self.sender.send_drops, steps_dropped=h.steps_dropped,
            alerts_active=self.evaluator.active(),
            last_step_age_s=None if last_step is None else max(0.0, now - last_step),
            restart_count=start.restart_count, restart_reason=start.restart_reason,
            telemetry_errors=self.telemetry_errors))
        return []
