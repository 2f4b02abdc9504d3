"""Threshold alerts over the engine's figures: pure logic, no sockets, no clock.

`AlertEvaluator` keeps one level per watched figure (``ok``/``warning``/``critical``) and is
*edge-triggered*: it returns an `AlertEvent` only when a figure's level changes (ok ->
warning, warning -> critical, critical -> warning, any -> ok), never while it stays put. A figure
rises to ``critical`` when ``value >= critical threshold``, to ``warning`` when ``value >= warning
threshold``. With *hysteresis* (config ``alert_hysteresis``, a fraction ``h``, default 0.1) it
leaves a level only once ``value < that level's threshold * (1 - h)``, the level's *release
point*: a figure hovering on a threshold raises once and clears once instead of flapping on every
crossing. Falling from ``critical`` it lands on ``warning`` while ``value >= warning threshold *
(1 - h)``. ``h = 0`` is plain thresholds.

Watched figures (names on the wire):

- ``step_time`` -- the **median step time of the last** ``alert_step_time_window_s`` (5 s) of
  steps (`observe_steps`), not one step's time and not one snapshot window's: on a loaded or
  shared machine single steps swing by a factor of four from one to the next (0.2 s, 0.9 s,
  0.3 s ...), and a 100 ms snapshot window holds one step or none, so judging either flapped on
  every step. One long prefill in a window of fast decodes is normal; a slow median means every
  step is slow. The level also has *hold times*: it rises only once the median has stayed at or
  above the threshold for ``alert_step_time_raise_s`` (2 s), and drops only once it has stayed
  under the release point for ``alert_step_time_clear_s`` (20 s) -- a noisy but steady machine
  raises once and clears once, a real slowdown still raises within seconds. The clock is the
  caller's ``now``. A running engine that finishes no step is not judged at all (stuck inside
  one step, it keeps its level); an idle engine's passes (``steps=0``) judge a window that
  empties, so idle clears after the window and the clear hold.
- ``waiting`` -- waiting-queue length.
- ``gpu_memory`` -- the highest used/total memory share over the devices.
- ``sched_share`` -- the scheduler's share of step time (warning only).
- ``fragmentation`` -- KV fragmentation (warning only, ``fragmentation_threshold``).

The figures other than ``step_time`` are judged on each reading as it comes (`observe`).
Thresholds come from `EngineConfig` and change hot through `update_config`, which re-judges
the last seen values so a lowered threshold alerts at once (``step_time``: after its hold).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from vconsole.shared.config import EngineConfig

OK, WARNING, CRITICAL = "ok", "warning", "critical"
_RANK = {OK: 0, WARNING: 1, CRITICAL: 2}
STEP_TIME = "step_time"

# name -> (config key of the warning threshold, of the critical one or None, what it is, unit)
RULES: dict[str, tuple[str, str | None, str, str]] = {
    STEP_TIME: ("alert_step_time_warning_s", "alert_step_time_critical_s",
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


class StepWindow:
    """The snapshot windows of steps of the last ``window_s`` seconds, as (end time, median step
    time, steps), and their median step time: each window's median weighted by its steps (a
    window of 40 fast steps outweighs one of a single slow step, as 40 steps do)."""

    def __init__(self) -> None:
        self._windows: deque[tuple[float, float, int]] = deque()

    def add(self, now: float, p50_s: float, steps: int, window_s: float) -> None:
        """A window of ``steps`` steps ending at ``now`` (0 steps: only time passed)."""
        if steps > 0:
            self._windows.append((now, p50_s, steps))
        while self._windows and self._windows[0][0] <= now - window_s:
            self._windows.popleft()

    def median(self) -> float:
        """The weighted median step time; 0.0 with no step in the window (nothing is slow)."""
        if not self._windows:
            return 0.0
        ordered = sorted((p50, n) for _, p50, n in self._windows)
        half = sum(n for _, n in ordered) / 2
        seen = 0
        for p50, n in ordered:
            seen += n
            if seen >= half:
                return p50
        return ordered[-1][0]


class AlertEvaluator:
    """Not thread-safe: owned by the publisher thread."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._levels: dict[str, str] = dict.fromkeys(RULES, OK)
        self._last: dict[str, float] = {}
        self._steps = StepWindow()
        self._step_now: float | None = None      # the time of the last step window
        self._pending: tuple[str, float] | None = None   # step_time: (level, since when)

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

    def _margin(self) -> float:
        return 1.0 - float(self._config.alert_hysteresis)

    def _target(self, name: str, value: float) -> tuple[str, float]:
        """The level ``value`` calls for (thresholds and release points) and its threshold."""
        warn, crit = self._thresholds(name)
        if crit is not None and value >= crit:
            level, threshold = CRITICAL, crit
        elif value >= warn:
            level, threshold = WARNING, warn
        else:
            level, threshold = OK, warn
        previous = self._levels[name]
        margin = self._margin()
        # Falling: keep the highest level at or below the previous one whose release point
        # (threshold * (1 - h)) the value has not yet fallen under.
        if previous == CRITICAL and level != CRITICAL and crit is not None \
                and value >= crit * margin:
            level, threshold = CRITICAL, crit
        elif previous != OK and level == OK and value >= warn * margin:
            level, threshold = WARNING, warn
        return level, threshold

    def _change(self, name: str, level: str, value: float, threshold: float,
                held_s: float = 0.0) -> AlertEvent:
        """Take the new level and say so (``held_s``: how long the value held before)."""
        previous = self._levels[name]
        self._levels[name] = level
        warn, crit = self._thresholds(name)
        margin = self._margin()
        _, _, what, unit = RULES[name]
        if name == STEP_TIME:
            what += f" of the last {self._config.alert_step_time_window_s:g} s"
        held = f" for {held_s:g} s" if held_s > 0 else ""
        if _RANK[level] < _RANK[previous]:
            left = crit if previous == CRITICAL and crit is not None else warn
            less = "" if margin == 1.0 else f" less {1 - margin:.0%}"
            msg = (f"{what} {'back' if level == OK else 'down'} to {_fmt(value, unit)} "
                   f"(under {_fmt(left * margin, unit)}{held}: {previous} threshold "
                   f"{_fmt(left, unit)}{less})")
        else:
            msg = (f"{what} is {_fmt(value, unit)} (>= {level} threshold "
                   f"{_fmt(threshold, unit)}{held})")
        return AlertEvent(name, level, previous, float(value), threshold, msg)

    def _judge(self, name: str, value: float) -> AlertEvent | None:
        level, threshold = self._target(name, value)
        if level == self._levels[name]:
            return None
        return self._change(name, level, value, threshold)

    def _judge_steps(self, now: float) -> AlertEvent | None:
        """``step_time``: the window's median against the levels, with the hold times."""
        value = self._steps.median()
        self._last[STEP_TIME] = value
        level, threshold = self._target(STEP_TIME, value)
        current = self._levels[STEP_TIME]
        if level == current:
            self._pending = None
            return None
        rising = _RANK[level] > _RANK[current]
        pending = self._pending
        if pending is None or (_RANK[pending[0]] > _RANK[current]) != rising:
            pending = self._pending = (level, now)     # the hold starts (or turns) here
        cfg = self._config
        hold = cfg.alert_step_time_raise_s if rising else cfg.alert_step_time_clear_s
        held = now - pending[1]
        if held < hold:
            return None
        self._pending = None
        return self._change(STEP_TIME, level, value, threshold, held_s=round(held, 1))

    def observe_steps(self, now: float, p50_s: float, steps: int) -> list[AlertEvent]:
        """One snapshot window of ``steps`` steps (median ``p50_s`` seconds) ending at ``now``
        (the caller's monotonic clock); ``steps=0``: an idle engine's pass, nothing is slow and
        the window only ages. Returns the ``step_time`` level change, if any."""
        self._step_now = now
        self._steps.add(now, float(p50_s), int(steps), self._config.alert_step_time_window_s)
        ev = self._judge_steps(now)
        return [] if ev is None else [ev]

    def observe(self, *, num_waiting: float | None = None,
                gpu_memory_share: float | None = None, sched_share: float | None = None,
                fragmentation: float | None = None) -> list[AlertEvent]:
        """Feed any subset of the figures judged per reading (None = no new reading, level
        kept); returns the level changes, in `RULES` order."""
        readings = {"waiting": num_waiting, "gpu_memory": gpu_memory_share,
                    "sched_share": sched_share, "fragmentation": fragmentation}
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
            if name == STEP_TIME:
                ev = None if self._step_now is None else self._judge_steps(self._step_now)
            else:
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
