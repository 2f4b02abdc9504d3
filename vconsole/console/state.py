"""The console's data model: what the telemetry stream has said, and nothing about widgets.

Each source's reader thread (`vconsole.console.sources.source.Source`: one per engine or group
watched, N for a fleet) calls `ConsoleState.ingest` for every multipart message; the UI reads
the model at most ~10 times a second. Both sides hold `ConsoleState.lock` while they touch it,
so the UI always sees a consistent picture (the latest payload of each topic is replaced
wholesale, never edited in place).

Per engine (``engine/rank`` from the envelope, so several endpoints can feed one console) the
model keeps the latest payload per topic, ring buffers for the sparklines (and ``trends``, a
15-minute `vconsole.console.trend_history.TrendHistory` for the Trends screen), the receive time of the
last heartbeat, and a count of messages lost to sequence gaps (``seq`` counts per topic per
publisher; a ``seq`` that goes backwards means the publisher restarted, not a loss).

Data parallel: every rank of a group is an engine of its own here (same engine name, its
``rank``); `ConsoleState.dp_ranks` finds a group and `ConsoleState.dp_aggregate` sums it up
(`vconsole.console.ranks`, shared with ``vconsole top``). A lone engine is unaffected.

Time comes from ``clock`` (wall seconds). Live it is ``time.time``; a replay substitutes its own
virtual clock, so ages on screen depend only on the recording — which keeps snapshots stable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vconsole.console.advisor import Advice
from vconsole.console.engine_state import Alert, ConfigView, EngineState
from vconsole.console.ranks import aggregate
from vconsole.console.trend_history import path_getter
from vconsole.telemetry.alerts import ENGINE_RESTART, RULES
from vconsole.telemetry.schema import SchemaError, SchemaVersionError, TelemetryMessage, decode

ALERT_HISTORY = 200

Clock = Callable[[], float]


class ConsoleState:
    """The whole console's model: engines by key, alerts, config, error counters."""

    def __init__(self, clock: Clock = time.time) -> None:
        self.lock = threading.RLock()
        self.clock: Clock = clock
        self.engines: dict[str, EngineState] = {}
        self.alerts: deque[Alert] = deque(maxlen=ALERT_HISTORY)
        self.alerts_seen = 0      # every alert ever listed (``alerts`` keeps the last ones)
        self.active_alerts: dict[tuple[str, str], Alert] = {}
        self.config: ConfigView | None = None
        self.primary: str | None = None   # the engine ``config`` is of (None: the first heard)
        # A fleet's imbalance findings in force (`sources.fleet.imbalance.Finding.json`), kept
        # by the app's fleet check for the Advice screen; empty outside a fleet.
        self.fleet_findings: list[dict[str, Any]] = []
        self.schema_error: str | None = None
        self.schema_error_ts = 0.0
        self.schema_errors = 0
        self.malformed = 0
        self.last_error: str | None = None
        self.last_error_ts = 0.0
        self.generation = 0
        self.messages = 0

    def now(self) -> float:
        return self.clock()

    # --- writing (reader thread) -------------------------------------------------------------

    def ingest(self, frames: Sequence[Any], recv_ts: float | None = None,
               engine_as: str | None = None) -> TelemetryMessage | None:
        """Decode one multipart message and fold it in. A bad message is counted and remembered
        (a schema version mismatch separately, so the UI can say exactly that), never raised.
        ``engine_as``: the name to keep it under instead of its envelope's (a fleet's target
        name: two engines both called ``engine-0`` stay two)."""
        ts = self.clock() if recv_ts is None else recv_ts
        try:
            msg = decode(frames)
        except SchemaVersionError as e:
            self.note_schema_error(str(e), ts)
            return None
        except SchemaError as e:
            with self.lock:
                self.malformed += 1
            self.note_error(str(e))
            return None
        if engine_as is not None:
            msg.payload["engine"] = engine_as
        try:
            self.ingest_message(msg, ts)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            # Envelope fine, fields of the wrong shape: count it, keep the reader alive.
            with self.lock:
                self.malformed += 1
            self.note_error(f"bad {msg.topic} payload: {type(e).__name__}: {e}")
            return None
        return msg

    def note_skipped(self, engine: str, rank: int, topic: str, seq: int) -> None:
        """A message the reader chose not to decode (an older snapshot conflated away, see
        `vconsole.console.sources.reader`): its ``seq`` counts as seen, not lost."""
        with self.lock:
            eng = self.engines.get(f"{engine}/{rank}")
            if eng is None:
                return
            eng.skipped += 1
            last = eng.last_seq.get(topic)
            if last is not None and seq > last:   # (a restart shows in the next decoded one)
                eng.dropped += seq - last - 1
                eng.last_seq[topic] = seq

    def note_schema_error(self, message: str, ts: float | None = None) -> None:
        with self.lock:
            self.schema_error = message
            self.schema_error_ts = self.clock() if ts is None else ts
            self.schema_errors += 1
            self.generation += 1

    def note_error(self, message: str) -> None:
        with self.lock:
            self.last_error = message
            self.last_error_ts = self.clock()
            self.generation += 1

    def recent_error(self, now: float | None = None, window_s: float = 10.0) -> str | None:
        """The last bad-message error, while recent (one odd message is not a lasting state)."""
        t = self.clock() if now is None else now
        if self.last_error is not None and t - self.last_error_ts <= window_s:
            return self.last_error
        return None

    def ingest_message(self, msg: TelemetryMessage, recv_ts: float) -> None:
        with self.lock:
            self.messages += 1
            self.generation += 1
            eng = self.engines.get(f"{msg.engine}/{msg.rank}")
            if eng is None:
                eng = self.engines[f"{msg.engine}/{msg.rank}"] = EngineState(msg.engine, msg.rank)
            if msg.topic == "health" and eng.was_down:
                eng.was_down = False
                eng.reconnects += 1
            if eng.apply(msg, recv_ts) and self._is_primary(eng) and self.config is not None:
                self.config.version = -1  # a restarted engine counts versions afresh
            if msg.topic == "alert":
                self._add_alert(msg, recv_ts)
            elif msg.topic == "health":
                self._note_restart(eng, msg.payload, recv_ts)
            elif msg.topic == "config" and self._is_primary(eng):
                self._set_config(msg.payload, recv_ts, "telemetry")

    def _is_primary(self, eng: EngineState) -> bool:
        if self.primary is not None:
            return eng.key == self.primary
        return next(iter(self.engines.values())) is eng

    def set_primary(self, key: str) -> None:
        """Make ``key`` the engine whose config ``config`` holds (a fleet's drill-in): its last
        ``config`` message now, else none until it announces one."""
        with self.lock:
            if key == self.primary:
                return
            self.primary = key
            self.config = None
            eng = self.engines.get(key)
            body = eng.latest.get("config") if eng is not None else None
            if body is not None and eng is not None:
                self._set_config(body, eng.recv_ts.get("config", self.clock()), "telemetry")
            self.generation += 1

    def _note_restart(self, eng: EngineState, health: dict[str, Any], recv_ts: float) -> None:
        """Every engine restart is listed once, even when its ``engine_restart`` event was
        lost (a subscriber reconnecting to a new process misses its first messages): health's
        ``restart_count`` says how many there were."""
        count = health.get("restart_count")
        if isinstance(count, int) and count > eng.restarts_listed:
            eng.restarts_listed = count
            # Dated when the restarted process started (its uptime back from this heartbeat,
            # on this console's clock), not when a console attached later first heard of it.
            uptime = path_getter("uptime_s")(health)
            since = recv_ts - uptime if uptime is not None and uptime >= 0 else recv_ts
            self._list_alert(Alert(
                since, eng.engine, eng.rank, ENGINE_RESTART, "critical", count, 0,
                f"engine restarted ({count}): {health.get('restart_reason') or 'unknown'}"))

    def _add_alert(self, msg: TelemetryMessage, recv_ts: float) -> None:
        p = msg.payload
        alert = Alert(recv_ts, msg.engine, msg.rank, str(p.get("name", "?")),
                      str(p.get("level", "warning")), p.get("value"), p.get("threshold"),
                      str(p.get("message", "")))
        if alert.name == ENGINE_RESTART:    # an event, listed once per restart, never "active"
            eng = self.engines[f"{msg.engine}/{msg.rank}"]
            if isinstance(alert.value, int | float) and alert.level != "ok" \
                    and int(alert.value) > eng.restarts_listed:
                eng.restarts_listed = int(alert.value)
                self._list_alert(alert)
            return
        self._list_alert(alert)
        key = (f"{msg.engine}/{msg.rank}", alert.name)
        if alert.level == "ok":
            self.active_alerts.pop(key, None)
        else:
            self.active_alerts[key] = alert

    def _list_alert(self, alert: Alert) -> None:
        self.alerts.append(alert)
        self.alerts_seen += 1

    def note_alert(self, alert: Alert) -> None:
        """An alert the console found itself (a fleet's imbalance): listed, and active until
        an ``ok`` of the same engine and name."""
        with self.lock:
            self._list_alert(alert)
            key = (f"{alert.engine}/{alert.rank}", alert.name)
            if alert.level == "ok":
                self.active_alerts.pop(key, None)
            else:
                self.active_alerts[key] = alert
            self.generation += 1

    def _set_config(self, reply: dict[str, Any], recv_ts: float, origin: str) -> None:
        values = reply.get("values")
        if not isinstance(values, dict):
            return
        version = int(reply.get("version") or 0)
        cur = self.config
        # An older snapshot that was in flight while a change was applied must not undo it.
        if cur is not None and version < cur.version and recv_ts - cur.recv_ts < 30.0:
            return
        schema = reply.get("schema") or (cur.schema if cur else [])
        self.config = ConfigView(dict(values), list(schema), version, recv_ts, origin)

    def set_config_reply(self, reply: dict[str, Any], recv_ts: float | None = None) -> None:
        """Fold in a control ``get_config`` reply (values, version, schema)."""
        with self.lock:
            self._set_config(reply, self.clock() if recv_ts is None else recv_ts, "control")
            self.generation += 1

    def apply_set_reply(self, reply: dict[str, Any]) -> None:
        """A ``set_config`` reply: what it applied is the engine's config now."""
        with self.lock:
            if self.config is not None and reply.get("applied"):
                self.config.values.update(reply["applied"])
                if isinstance(reply.get("version"), int):
                    self.config.version = reply["version"]
                self.config.recv_ts = self.clock()
            self.generation += 1

    # --- reading (UI thread, under lock) ------------------------------------------------------

    def schema_problem(self, now: float | None = None) -> str | None:
        """The last schema version mismatch, while it is recent (mismatched messages keep
        coming as long as the engine runs, so a quiet 10 s means it went away)."""
        t = self.clock() if now is None else now
        if self.schema_error is not None and t - self.schema_error_ts <= 10.0:
            return self.schema_error
        return None

    def engine_list(self) -> list[EngineState]:
        return list(self.engines.values())

    def engine(self, key: str | None = None) -> EngineState | None:
        if key is not None and key in self.engines:
            return self.engines[key]
        return next(iter(self.engines.values()), None)

    # --- data parallel (one endpoint, every rank of a group) ---------------------------------

    def dp_ranks(self, eng: EngineState | None = None) -> list[EngineState]:
        """The ranks of ``eng``'s data-parallel group (default: the first engine's), by rank: the
        engines heard with its engine name. Empty unless it is a group — a rank sent the ``dp``
        topic, or several ranks of that name are heard. A lone engine is never a group."""
        eng = eng if eng is not None else self.engine()
        if eng is None:
            return []
        group = sorted((e for e in self.engines.values() if e.engine == eng.engine),
                       key=lambda e: e.rank)
        if len(group) > 1 or self.dp_world_size(group) > 1:
            return group
        return []

    @staticmethod
    def dp_world_size(ranks: Sequence[EngineState]) -> int:
        """The group's size: the largest ``world_size`` a rank reported, at least the ranks
        heard (a rank not heard yet still counts once another one names the size)."""
        sizes = [int(w) for e in ranks
                 if isinstance(w := e.latest.get("dp", {}).get("world_size"), int)]
        return max([len(ranks), *sizes]) if ranks else 0

    def dp_aggregate(self, ranks: Sequence[EngineState], now: float | None = None
                     ) -> dict[str, Any]:
        """`vconsole.console.ranks.aggregate` over the ranks that serve: a rank that is down or
        restarting is left out (its last figures are stale), and named in ``left_out``; of a
        restarted rank only what its new process sent counts (`EngineState.live_bodies`)."""
        t = self.clock() if now is None else now
        live = {e.rank: e.live_bodies() for e in ranks
                if e.status(t) not in ("down", "restarting")}
        out = aggregate(live)
        out["left_out"] = [e.rank for e in ranks if e.rank not in live]
        out["world_size"] = max(out["world_size"], self.dp_world_size(ranks))
        return out

    def mark_down(self, now: float | None = None) -> list[EngineState]:
        """Flag engines that went stale, so the next heartbeat counts as a reconnect; return the
        engines that just went down."""
        t = self.clock() if now is None else now
        went: list[EngineState] = []
        with self.lock:
            for eng in self.engines.values():
                if eng.is_stale(t) and not eng.was_down:
                    eng.was_down = True
                    went.append(eng)
        return went

    def latest_alerts(self, n: int) -> list[Alert]:
        with self.lock:
            return list(self.alerts)[-n:][::-1]

    def alerts_active(self, eng: EngineState) -> dict[str, str]:
        """Figure -> level of ``eng``'s alerts active now: its last heartbeat's
        ``alerts_active``, brought up to date by the level changes heard after that heartbeat.
        A change goes out at once, the heartbeat only every ``heartbeat_interval_s``, so for up
        to an interval (and in a replay paused between the two) the heartbeat still names an
        alert the engine has just cleared. With no heartbeat that says, the changes this
        console heard. Events that are never active (restarts, advice) are not counted."""
        with self.lock:
            health = eng.latest.get("health", {})
            beat = health.get("alerts_active")
            out = {str(k): str(v) for k, v in beat.items()} if isinstance(beat, dict) else {}
            since = eng.recv_ts.get("health") if isinstance(beat, dict) else None
            for a in self.alerts:
                if a.engine != eng.engine or a.rank != eng.rank or a.name not in RULES:
                    continue
                if since is not None and a.recv_ts <= since:
                    continue       # the heartbeat sent after it already counts it
                if a.level == "ok":
                    out.pop(a.name, None)
                else:
                    out[a.name] = a.level
            return out

    def alert_summary(self, now: float, window_s: float = 60.0) -> list[tuple[Alert, int]]:
        """The latest alert per (engine, name), newest first, with how many times it changed
        level in the last ``window_s``. Alerts are edge-triggered; hysteresis
        (``alert_hysteresis``) keeps a figure hovering on a threshold from flapping, but one that
        swings wide still changes level often, and this keeps one line per figure."""
        with self.lock:
            latest: dict[tuple[str, str], Alert] = {}
            counts: dict[tuple[str, str], int] = {}
            for a in self.alerts:
                key = (f"{a.engine}/{a.rank}", a.name)
                latest[key] = a
                if now - a.recv_ts <= window_s:
                    counts[key] = counts.get(key, 0) + 1
        items = sorted(latest.items(), key=lambda kv: kv[1].recv_ts, reverse=True)
        return [(a, counts.get(key, 0)) for key, a in items]

    def advice(self, eng: EngineState | None) -> list[Advice]:
        """The advisor's current suggestions for ``eng``. The primary engine's advisor first
        takes the config this console holds (a control reply can be newer than telemetry's)."""
        if eng is None:
            return []
        with self.lock:
            if self.config is not None and self._is_primary(eng):
                eng.advisor.set_config(self.config.values)
            return eng.advisor.current()

    def note_advice_outcome(self, eng: EngineState | None, rule: str, ok: bool,
                            message: str) -> None:
        """Record what became of an applied suggestion in the alert history, so the Alerts
        panel shows it beside the engine's own alerts (name ``advice RULE``)."""
        with self.lock:
            self._list_alert(Alert(self.clock(), eng.engine if eng else "console",
                                     eng.rank if eng else 0, f"advice {rule}",
                                     "ok" if ok else "warning", None, None, message))
            self.generation += 1

    def feed(self, items: Iterable[tuple[float, Sequence[Any]]]) -> None:
        """Ingest many (recv_ts, frames) records at once (tests, instant replay)."""
        for ts, frames in items:
            self.ingest(frames, ts)
