"""The data-parallel *wave* state machine of one rank, as pure logic (no torch, no sockets, no
clock: times are passed in).

A wave is a stretch of steps during which every rank of the group steps in lockstep, so that
the group's collective calls line up: a rank with requests runs real steps, a rank without runs
dummy steps. vLLM's DP wave protocol, one rank's half:

- waves are numbered from 0; ``wave`` is the number of the current (or next) wave;
- `start` (a request arrived at this rank while no wave runs): the wave ``wave`` starts here;
  the caller tells the other ranks (through the front end), which get `on_start_wave`;
- `on_start_wave(w)`: ``w < wave`` is stale (that wave already completed here) and ignored;
  otherwise this rank adopts ``w`` and, if no wave runs, starts it;
- `on_step` counts each step of the running wave and says when the "is any rank busy"
  all-reduce is due: after every ``sync_every``-th step of the wave. Every rank of the group
  starts a wave at step 0 and counts the same way, so they all reach the all-reduce at the same
  step of the wave (the all-reduce itself is the barrier that keeps them together);
- `on_sync_result(any_busy)`: no rank busy → the wave completes on every rank at this same step
  (a `CompletedWave`), ``wave`` advances and no wave runs until the next start;
- `abandon` (the group broke) and `restart_numbering(w)` (a new group agreed on ``w``) end any
  running wave without completing it.

Invariants: ``wave`` never decreases; ``steps`` and ``dummy_steps`` count the running wave only
(0 while none runs); a completed wave's number is the ``wave`` it ran as.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletedWave:
    """What a rank publishes when a wave completes (the ``wave`` telemetry topic)."""

    wave: int
    steps: int
    dummy_steps: int
    duration_s: float


class WaveState:
    """One rank's wave number, whether a wave runs, and the running wave's step counters."""

    def __init__(self, sync_every: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        self.wave = 0
        self.running = False
        self.steps = 0              # steps of the running wave (real + dummy)
        self.dummy_steps = 0        # of which dummy
        self.started_at = 0.0       # the caller's clock when the running wave started

    def start(self, now: float) -> bool:
        """A request is here and no wave runs: start wave ``wave``. True if it started (False:
        one already runs)."""
        if self.running:
            return False
        self._begin(now)
        return True

    def on_start_wave(self, wave: int, now: float) -> bool:
        """Another rank started ``wave``. True if this rank starts it now; False when it is
        stale (``wave`` < ours) or a wave already runs here (its number is adopted if higher)."""
        if wave < self.wave:
            return False
        self.wave = wave
        if self.running:
            return False
        self._begin(now)
        return True

    def on_step(self, dummy: bool) -> bool:
        """Count one step of the running wave; True when the all-reduce is due after it.
        A step outside a wave counts nothing and never syncs."""
        if not self.running:
            return False
        self.steps += 1
        if dummy:
            self.dummy_steps += 1
        return self.steps % self.sync_every == 0

    def on_sync_result(self, any_busy: bool, now: float) -> CompletedWave | None:
        """The all-reduce's answer. Some rank busy: the wave goes on (None). Nobody busy: the
        wave completes here (as on every rank) and the next one gets the next number."""
        if not self.running or any_busy:
            return None
        done = CompletedWave(self.wave, self.steps, self.dummy_steps,
                             max(0.0, now - self.started_at))
        self.wave += 1
        self._end()
        return done

    def abandon(self) -> None:
        """The group broke: stop the running wave without completing it. The number stays;
        the next group agrees on one (`restart_numbering`)."""
        self._end()

    def restart_numbering(self, wave: int) -> None:
        """A new group agreed on the wave number (the highest of its ranks): no wave runs, the
        next one is ``wave``. Never goes back."""
        self.wave = max(self.wave, wave)
        self._end()

    def _begin(self, now: float) -> None:
        self.running = True
        self.steps = 0
        self.dummy_steps = 0
        self.started_at = now

    def _end(self) -> None:
        self.running = False
        self.steps = 0
        self.dummy_steps = 0
