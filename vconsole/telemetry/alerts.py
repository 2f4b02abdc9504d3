"""Threshold alerts over the engine's figures: pure logic, no sockets, no clock.

`AlertEvaluator` keeps one level per watched figure (``ok``/``warning``/``critical``) and is
*edge-triggered*: `observe` returns an `AlertEvent` only when a figure's level changes (ok ->
warning, warning -> critical, critical -> warning, any -> ok), never while it stays put. A figure
rises to ``critical`` when ``value >= critical threshold``, to ``warning`` when ``value >= warning
threshold``. With *hysteresis* (config ``alert_hysteresis``, a fraction ``h``, default 0.1) it
leaves a level only once ``value < that level's threshold * (1 - h)``: a figure hovering on a
threshold raises once and clears once instead of flapping on every crossing. Falling from
``critical`` it lands on ``warning`` while ``value >= warning threshold * (1 - h)``. ``h = 0`` is
plain thresholds.

Watched figures (names on the wire):

- ``step_time`` -- the window's **p50** step time in seconds, not its max: one long prefill in a
  window of fast decodes is normal, a slow median means every step is slow. A stuck engine still
  shows, because a window with one 5-second step has a 5-second median.
- ``waiting`` -- waiting-queue length.
- ``gpu_memory`` -- the highest used/total memory share over the devices.
- ``sched_share`` -- the scheduler's share of step time (warning only).
- ``fragmentation`` -- KV fragmentation (warning only, ``fragmentation_threshold``).

Thresholds come from `EngineConfig` and change hot through `update_config`, which re-judges
the last seen values so a lowered threshold alerts at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vconsole.shared.config import EngineConfig

OK, WARNING, CRITICAL = "ok", "warning", "critical"
_RANK = {OK: 0, WARNING: 1, CRITICAL: 2}

# name -> (config key of the warning threshold, of the critical one or None, what it is, unit)
RULES: dict[str, tuple[str, str | None, str, str]] = {
    "step_time": ("alert_step_time_warning_s", "alert_step_time_critical_s",
                  "median step time", "s"),
    "waiting": ("alert_waiting_warning", "alert_waiting_critical", "waiting requests", ""),
    "gpu_memory": ("alert_gpu_memory_warning", "alert_gpu_memory_critical",
                   "GPU memory in use", "share"),
    "sched_share": ("alert_sched_share_warning", None, "scheduler share of step time", "share"),
    "fragmentation": ("fragmentation_threshold", None, "KV cache fragmentation", "share"),
}


@dataclass(frozen=True)
class AlertEvent:
    """One level change; `payload` is the ``alert`` topic body (without the envelope).

    ``threshold`` is the one crossed: the new level's threshold going up, and on recovery to ok
    the warning threshold the value fell back under."""

    name: str
    level: str
    previous: str
    value: float
    threshold: float
    message: str

    def payload(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(value: float, unit: str) -> str:
    if unit == "share":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:g}"


class AlertEvaluator:
    """Not thread-safe: owned by the publisher thread."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._levels: dict[str, str] = dict.fromkeys(RULES, OK)
        self._last: dict[str, float] = {}

    @property
    def levels(self) -> dict[str, str]:
        """Current level of every watched figure (a copy)."""
        return dict(self._levels)

    def active(self) -> dict[str, str]:
        """Figures not at ok: what a late subscriber needs, since events are edge-triggered."""
        return {k: v for k, v in self._levels.items() if v != OK}

    def _thresholds(self, name: str) -> tuple[float, float | None]:
        warn_key, crit_key, _, _ = RULES[name]
        warn = float(getattr(self._config, warn_key))
        crit = None if crit_key is None else float(getattr(self._config, crit_key))
        return warn, crit

    def _judge(self, name: str, value: float) -> AlertEvent | None:
        warn, crit = self._thresholds(name)
        if crit is not None and value >= crit:
            level, threshold = CRITICAL, crit
        elif value >= warn:
            level, threshold = WARNING, warn
        else:
            level, threshold = OK, warn
        previous = self._levels[name]
        margin = 1.0 - float(self._config.alert_hysteresis)
        # Falling: keep the highest level at or below the previous one whose release point
        # (threshold * (1 - h)) the value has not yet fallen under.
        if previous == CRITICAL and level != CRITICAL and crit is not None \
                and value >= crit * margin:
            level, threshold = CRITICAL, crit
        elif previous != OK and level == OK and value >= warn * margin:
            level, threshold = WARNING, warn
        if level == previous:
            return None
        self._levels[name] = level
        _, _, what, unit = RULES[name]
        if _RANK[level] < _RANK[previous]:
            left = crit if previous == CRITICAL and crit is not None else warn
            less = "" if margin == 1.0 else f" less {1 - margin:.0%}"
            msg = (f"{what} {'back' if level == OK else 'down'} to {_fmt(value, unit)} "
                   f"(under {_fmt(left * margin, unit)}: {previous} threshold "
                   f"{_fmt(left, unit)}{less})")
        else:
            msg = f"{what} is {_fmt(value, unit)} (>= {level} threshold {_fmt(threshold, unit)})"
        return AlertEvent(name, level, previous, float(value), threshold, msg)

    def observe(self, *, step_time_s: float | None = None, num_waiting: float | None = None,
                gpu_memory_share: float | None = None, sched_share: float | None = None,
                fragmentation: float | None = None) -> list[AlertEvent]:
        """Feed any subset of the figures (None = no new reading, level kept); returns the
        level changes, in `RULES` order."""
        readings = {"step_time": step_time_s, "waiting": num_waiting,
                    "gpu_memory": gpu_memory_share, "sched_share": sched_share,
                    "fragmentation": fragmentation}
        events = []
        for name, value in readings.items():
            if value is None:
                continue
            self._last[name] = float(value)
            ev = self._judge(name, float(value))
            if ev is not None:
                events.append(ev)
        return events

    def update_config(self, config: EngineConfig) -> list[AlertEvent]:
        """New thresholds; re-judges the last readings and returns any level changes."""
        self._config = config
        events = []
        for name, value in self._last.items():
            ev = self._judge(name, value)
            if ev is not None:
                events.append(ev)
        return events


# Events that are not thresholds: sent as they happen on the ``alert`` topic, same fields.
ENGINE_RESTART = "engine_restart"      # the supervisor restarted the engine process
TELEMETRY_ERROR = "telemetry_error"    # a telemetry cache failed on the busy loop (guarded)


def restart_event(count: int, reason: str | None, *, back: bool) -> AlertEvent:
    """An engine restart: ``critical`` from the supervisor while no engine runs, ``ok`` from
    the restarted engine once it serves again. ``value`` is the restart count, so a console
    lists each restart once however many of the two it hears."""
    why = reason or "unknown reason"
    if back:
        return AlertEvent(ENGINE_RESTART, OK, CRITICAL, float(count), 0.0,
                          f"engine serving again after restart {count} ({why})")
    return AlertEvent(ENGINE_RESTART, CRITICAL, OK, float(count), 0.0,
                      f"engine restarting ({count}): {why}")


def telemetry_error_event(part: str, message: str, total: int) -> AlertEvent:
    """A telemetry failure the busy loop survived (`vconsole.engine.telemetry_guard`)."""
    return AlertEvent(TELEMETRY_ERROR, WARNING, OK, float(total), 0.0,
                      f"telemetry ({part}) failed, rebuilt; serving goes on "
                      f"({total} so far): {message}")
