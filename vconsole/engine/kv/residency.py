"""How long KV blocks live, sampled: vLLM's ``--kv-cache-metrics`` (``vllm/v1/core/
kv_cache_metrics.py``) on our `BlockPool`.

What is measured is vLLM's, point for point: a sampled block is born when it is allocated;
each prefix-cache hit on it (`BlockPool.touch`) is an access; its life ends when the pool hands
it out again (eviction happens exactly then: `vconsole.engine.kv.block_pool`), and that end is
one sample: lifetime (end − birth), idle before eviction (end − last access, or − birth when
it was never hit) and the gaps between its last `HISTORY` accesses. A block still alive is no
sample yet; a prefix-cache reset forgets the tracked blocks, as vLLM's ``reset``.

What differs is how blocks are picked: vLLM draws ``random.random() < rate`` per allocated
block; here a countdown takes every ``round(1 / rate)``-th allocation, so an allocation of n
blocks costs O(1) plus O(blocks sampled), and an untracked pool (`tracking` False) costs a
touch nothing. With the feature off the pool holds no `BlockResidency` at all (one None check
per call: the what-if simulator's pools never have one).

Samples wait in `samples` (bounded: `MAX_PENDING`, the rest counted in ``dropped``) until the
telemetry feed takes them (`take`); the histograms are the publisher's.

Given the pool's size, it also stamps every block (not only the sampled ones) each time it is
allocated or hit (`stamps`, monotonic ns, 0: never): the KV map's age view (`ages`), what the
console colours by "time since last touched". One clock read per allocation or hit and one
store per block (an ``array``: no numpy call on the busy loop), only while the feature is on.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from vconsole.shared.stats import ResidencySample as Sample

HISTORY = 4               # accesses kept per block (vLLM's ``deque(maxlen=4)``)
MAX_PENDING = 1 << 16     # samples kept until taken; more are dropped and counted
DEFAULT_SAMPLE_RATE = 0.01


class BlockResidency:
    """The sampled blocks of one pool. ``_tracked[b]`` is ``[birth_ns, last_access_ns,
    *access_ns]`` (at most `HISTORY` accesses, oldest first)."""

    __slots__ = ("every", "_left", "_tracked", "samples", "dropped", "_clock", "stamps")

    def __init__(self, sample_rate: float = DEFAULT_SAMPLE_RATE,
                 clock: Callable[[], int] = time.monotonic_ns, num_blocks: int = 0) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate}")
        self.every = max(1, round(1.0 / sample_rate))
        self._left = self.every            # allocations until (and including) the next sample
        self._tracked: dict[int, list[int]] = {}
        self.samples: list[Sample] = []
        self.dropped = 0
        self._clock = clock
        self.stamps = array("q", bytes(8 * num_blocks))  # per block: last allocated or hit

    @property
    def tracking(self) -> bool:
        return bool(self._tracked)

    def tracked(self) -> list[int]:
        """The blocks being followed now (tests)."""
        return list(self._tracked)

    def allocated(self, blocks: Sequence[int]) -> None:
        """``blocks`` were just handed out (in order): a tracked one among them was evicted,
        and every `every`-th allocation is followed from now on."""
        tracked = self._tracked
        now = 0
        stamps = self.stamps
        if stamps:
            now = self._clock()
            for b in blocks:
                stamps[b] = now
        if tracked:
            for b in blocks:
                state = tracked.pop(b, None)
                if state is not None:
                    now = now or self._clock()
                    self._evicted(state, now)
        n = len(blocks)
        if n < self._left:
            self._left -= n
            return
        now = now or self._clock()
        i = self._left - 1
        while i < n:
            tracked[blocks[i]] = [now, now]
            i += self.every
        self._left = i - n + 1

    def touched(self, blocks: Sequence[int]) -> None:
        """A prefix-cache hit on each of ``blocks``."""
        tracked = self._tracked
        now = 0
        stamps = self.stamps
        if stamps:
            now = self._clock()
            for b in blocks:
                stamps[b] = now
        if not tracked:
            return
        for b in blocks:
            state = tracked.get(b)
            if state is not None:
                now = now or self._clock()
                state[1] = now
                state.append(now)
                if len(state) > 2 + HISTORY:
                    del state[2]

    def _evicted(self, state: list[int], now: int) -> None:
        if len(self.samples) >= MAX_PENDING:
            self.dropped += 1
            return
        accesses = state[2:]
        gaps = tuple((b - a) / 1e9 for a, b in zip(accesses, accesses[1:], strict=False))
        self.samples.append(((now - state[0]) / 1e9, (now - state[1]) / 1e9, gaps))

    def ages(self) -> np.ndarray:
        """Seconds since each block was last allocated or hit (float32; NaN: never)."""
        stamps = np.frombuffer(self.stamps, np.int64) if self.stamps else np.zeros(0, np.int64)
        age = ((self._clock() - stamps) / 1e9).astype(np.float32)
        age[stamps == 0] = np.nan
        return age

    def reset(self) -> None:
        """The prefix cache was reset: stop following every block (vLLM's ``reset``)."""
        self._tracked.clear()

    def take(self) -> list[Sample]:
        """The samples since the last call, taken out."""
        out, self.samples = self.samples, []
        return out
