"""How many tokens to draft: what a draft is expected to gain against what its rows cost.

A draft of ``d`` tokens turns a request's one row of a decode step into ``1 + d`` rows, and the
step emits ``1 + a`` tokens for it, ``a`` the drafts accepted. On a CPU a step's time grows with
its rows (SmolLM2's native step, quiet: a 4-token draft's 5 rows take 1.55x one row's time), so
a draft that is rarely accepted makes decoding slower: free chat, where a lookup match is a
coincidence, lost 5-10% with every match drafted (docs/speculative.md). `DraftLength` picks,
for each request and step, the length ``d`` in ``0 .. k`` that maximises the step's expected
tokens per second::

    (R - 1 + E(d)) / t(R + d),    E(d) = 1 + sum over i = 1 .. d of P(the first i accepted)

``R``: the rows of the step the draft is for (those of the step just run, the best guess of
the next, plus the draft rows already given to the requests before it in that step, so that
several requests drafting at once do not each price the step as if alone); ``t(r)``: the
median time of the last steps of ``r`` rows with no prefill chunk
(`StepCosts`, the runner's own measurements; a width not measured yet costs what the widest
narrower measured one does, an optimistic guess that gets it measured); ``P``: the request's
own record of its drafts (how many of its drafts of at least ``i`` tokens had the first ``i``
accepted, `Acceptance`), shrunk towards the record of every request's drafts from matches of
the same length while it has few drafts (a 2-token match is a weaker guess than a 4-token
one: on free chat most matches are common pairs of tokens, rarely right; a request's own
record comes too late in a short answer). A
request whose drafts stopped paying drafts nothing, but is given a 1-token draft every
`PROBE_EVERY` matches so its record can recover. The choice changes only how fast tokens come:
every draft is verified, so the greedy text and the sampled distribution are the same at any
length. ``"draft_length": "fixed"`` in the speculative config drafts the whole match, as vLLM.
"""

from __future__ import annotations

from collections import defaultdict, deque
from statistics import median

WINDOW = 32             # step times kept per width (the median of these)
MIN_SAMPLES = 3         # steps of a width before its median is trusted
PRIOR_WEIGHT = 4.0      # drafts' worth of the shared record in a request's estimate
PROBE_EVERY = 8         # a request that drafts nothing still drafts 1 token every 8th match


class StepCosts:
    """The median duration of the last `WINDOW` steps of each width (rows, no prefill). The
    median is taken once per step, when a step is observed, not at each of the many `time`
    calls a step's draft choices make (the engine's busy loop)."""

    def __init__(self) -> None:
        self._times: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
        self._medians: dict[int, float] = {}    # widths with `MIN_SAMPLES` steps or more

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            times = self._times[rows]
            times.append(seconds)
            if len(times) >= MIN_SAMPLES:
                self._medians[rows] = median(times)

    def time(self, rows: int) -> float | None:
        """Seconds for a step of ``rows`` rows: measured, else the widest narrower measured
        width's (optimistic: a width is tried, then known); None before any step. A width
        is measured after `MIN_SAMPLES` steps: one stalled step (a page fault, another
        process on the core: seen at 1.2 s against 10 ms) must not price a width out for
        good, since a width never chosen is never measured again."""
        known = [r for r in self._medians if r <= rows]
        return self._medians[max(known)] if known else None


class Acceptance:
    """``hits[i]`` / ``tries[i]``: of the drafts of at least ``i + 1`` tokens, how many had
    their first ``i + 1`` accepted."""

    def __init__(self, k: int) -> None:
        self.tries = [0] * k
        self.hits = [0] * k

    def record(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, len(self.tries))):
            self.tries[i] += 1
            self.hits[i] += i < accepted

    def p(self, i: int, base: float) -> float:
        """P(the first ``i + 1`` tokens of a draft accepted), shrunk towards ``base`` (worth
        `PRIOR_WEIGHT` drafts)."""
        return (self.hits[i] + PRIOR_WEIGHT * base) / (self.tries[i] + PRIOR_WEIGHT)


class DraftLength:
    """Per request, the draft length worth its rows (see the module docstring)."""

    def __init__(self, k: int, costs: StepCosts, adaptive: bool = True) -> None:
        self.k, self.costs, self.adaptive = k, costs, adaptive
        self.all = Acceptance(k)
        self.by_match: dict[int, Acceptance] = defaultdict(lambda: Acceptance(k))
        self._mine: dict[str, Acceptance] = {}
        self._skipped: dict[str, int] = defaultdict(int)

    def shared(self, i: int, match: int) -> float:
        """Every request's P(first ``i + 1`` accepted) for matches of ``match`` tokens, itself
        shrunk towards all matches' (and that towards 1/2 per token, before any draft)."""
        a = self.all
        overall = (a.hits[i] + 0.5 ** (i + 1)) / (a.tries[i] + 1)
        return self.by_match[match].p(i, overall) if match in self.by_match else overall

    def choose(self, req_id: str, available: int, rows: int, match: int = 0) -> int:
        """Tokens of an ``available``-token match of ``match`` tokens to draft for ``req_id``
        in a step of about ``rows`` rows (0: none)."""
        d_max = min(self.k, available)
        if not self.adaptive or d_max <= 0:
            return d_max
        t1 = self.costs.time(max(rows, 1))
        if t1 is None:
            return d_max
        mine = self._mine.get(req_id) or Acceptance(self.k)
        R = max(rows, 1)
        best, best_rate, expected = 0, R / t1, 1.0
        for d in range(1, d_max + 1):
            expected += mine.p(d - 1, self.shared(d - 1, match))
            t = self.costs.time(R + d) or t1
            rate = (R - 1 + expected) / t
            if rate > best_rate:
                best, best_rate = d, rate
        if best == 0:
            self._skipped[req_id] += 1
            if self._skipped[req_id] % PROBE_EVERY == 0:
                return 1
        return best

    def record(self, req_id: str, drafted: int, accepted: int, match: int = 0) -> None:
        """A verified draft from a ``match``-token match: ``accepted`` of its ``drafted``."""
        mine = self._mine.get(req_id)
        if mine is None:
            mine = self._mine[req_id] = Acceptance(self.k)
        mine.record(drafted, accepted)
        self.all.record(drafted, accepted)
        self.by_match[match].record(drafted, accepted)

    def forget(self, live: set[str]) -> None:
        """Drop the records of requests no longer running."""
        for rid in [r for r in self._mine if r not in live]:
            del self._mine[rid]
        for rid in [r for r in self._skipped if r not in live]:
            del self._skipped[rid]
