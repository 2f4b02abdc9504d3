"""When the console may refresh its screen: a token bucket for wake-ups, and the age tick.

The reader thread wakes the app whenever a snapshot came (`vconsole.console.sources.stream`);
the app asks `RefreshPacer.spend` whether it may refresh now. The bucket fills at ``rate_hz``
tokens a second and saves up at most ``burst``: a snapshot is shown at once while a token is
there, else as soon as one is (``spend`` says how long that is). A plain "at least a period
since the last refresh" rule chains: one late refresh would delay every later snapshot too.

The app's timer refreshes without a wake-up only when the last refresh is ``age_tick_s`` old
(`tick_due`: ages move, the 1 Hz topics show), so it never takes the slot a snapshot arriving
right after needs. Together: new snapshots show promptly, and the screen refreshes at most
~``rate_hz`` times a second plus the burst, whatever the message rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WAKE_BURST = 2.0      # refreshes a wake-up may spend at once
AGE_TICK_S = 0.5      # refresh this often without a wake-up (ages move, 1 Hz topics)


class RefreshPacer:
    """See the module docstring. ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, rate_hz: float, *, burst: float = WAKE_BURST,
                 age_tick_s: float = AGE_TICK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_hz = rate_hz
        self.burst = burst
        self.age_tick_s = age_tick_s
        self._clock = clock
        self._tokens = burst                 # the wake-ups' refresh budget, and when it was
        self._tokens_ts = clock()            # last topped up
        self._last_refresh = 0.0

    @property
    def interval_s(self) -> float:
        return 1.0 / self.rate_hz

    def spend(self, force: bool = False) -> float:
        """Spend a refresh token and return 0, or return the seconds until one is there
        (``force``: spend it anyway, going into debt — the held refresh is due now)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._tokens_ts) * self.rate_hz)
        self._tokens_ts = now
        if self._tokens >= 1.0 or force:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate_hz

    def refreshed(self) -> None:
        """The screen was refreshed just now (by a wake-up, the timer or an action)."""
        self._last_refresh = self._clock()

    def tick_due(self) -> bool:
        """The timer should refresh: nothing has for ``age_tick_s``."""
        return self._clock() - self._last_refresh >= self.age_tick_s
