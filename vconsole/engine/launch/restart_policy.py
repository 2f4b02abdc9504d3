"""How a supervisor paces restarts: the backoff and the give-up rule, apart from the processes
they govern so they are tested with a made-up clock (`vconsole.engine.launch.supervisor` uses
it for its engine child)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """When to restart and when to give up: at most ``max_restarts`` failures within any
    ``window_s`` are restarted; the delay before a restart doubles with each failure still in
    the window, from ``backoff_s`` up to ``backoff_max_s`` (or ``backoff_s`` if that is
    longer; an engine that served for a whole window starts over at ``backoff_s``). Pure: the
    caller passes the clock."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    _failures: collections.deque[float] = field(default_factory=collections.deque, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0 or not self.backoff_s > 0:
            raise ValueError("the restart window and the backoff must be > 0")

    @property
    def failures_in_window(self) -> int:
        return len(self._failures)

    def on_failure(self, now: float) -> float | None:
        """Record a failure at ``now``: the delay before the next start, or None to give up."""
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.window_s:
            self._failures.popleft()
        n = len(self._failures)
        if n > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (n - 1), max(self.backoff_max_s, self.backoff_s))
