"""`bench structured`'s listener on the engine's telemetry: the ``step`` phases summed per
run (the structured phase's share of the busy time) and the ``sched`` compile counters."""

from __future__ import annotations

import threading
from typing import Any

COMPILE_COUNTERS = ("structured_compiles_total", "structured_compile_cache_hits_total",
                    "structured_compile_errors_total", "structured_compile_seconds_total")


class Phases:
    """The engine's ``step`` telemetry summed per label (the bench names what runs), and its
    latest ``sched`` compile counters, from a listener thread."""

    def __init__(self, endpoint: str) -> None:
        from vconsole.telemetry.listener import TelemetryListener

        self.label: str | None = None
        self.sums: dict[str, dict[str, float]] = {}
        self.counters: dict[str, float] = {}
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on, topics=("step", "sched"))

    def _on(self, msg: Any) -> None:
        p = msg.payload
        with self._lock:
            if msg.topic == "sched":
                self.counters = {k: float(p[k]) for k in COMPILE_COUNTERS if k in p}
            elif self.label is not None:
                acc = self.sums.setdefault(self.label, {})
                acc["busy_s"] = acc.get("busy_s", 0.0) + float(p.get("busy_s") or 0.0)
                acc["steps"] = acc.get("steps", 0.0) + float(p.get("steps") or 0)
                for k, v in (p.get("phase_s") or {}).items():
                    acc[k] = acc.get(k, 0.0) + float(v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    def share(self, label: str, phase: str = "structured") -> float | None:
        """``phase``'s seconds over the busy seconds of the steps run under ``label`` (None
        when the engine reports no such phase)."""
        with self._lock:
            acc = self.sums.get(label, {})
            if phase not in acc or not acc.get("busy_s"):
                return None
            return round(acc[phase] / acc["busy_s"], 4)

    def close(self) -> None:
        self._listener.close(None)
