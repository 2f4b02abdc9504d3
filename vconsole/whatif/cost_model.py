"""The step-time model: what one engine step costs, fitted from the trace's own step records.

A step's cost is linear in what it computes (each coefficient fitted, none assumed)::

    dur    = c0 + c_py * (not native) + c_pf * prefill tokens + c_dec * decode rows
             + c_ctx * context tokens + c_attn * prefill attention + c_new * requests new
    period = dur + o0 + o_req * requests scheduled        (when the engine went straight on)

- ``c0``: the fixed cost of a step (a forward over every layer however small the batch: on a
  CPU the weights stream from memory once per step);
- ``c_py``: the fixed cost of a step that runs the Python layers rather than one native call
  (`vconsole.engine.worker.native_decode`: pure-decode steps of up to `native_rows` rows on the
  CPU): the interpreter and dispatcher around some 40 ops per layer. A trace records each step's
  regime (``StepRecord.native``) and the widest native step (``native_decode_rows`` in its
  header); the simulation gives a step the native regime by the same rule the engine applies
  (`StepCostModel.runs_native`). Without it one line over both regimes was biased for a variant
  whose steps cross from one to the other (#44: 1-4 row decode steps ran 1.25-1.6x faster
  natively). A trace with no native step has no such term (its column never varies);
- ``c_pf`` / ``c_dec``: per prefill token and per decode row (the linears, sampling);
- ``c_ctx``: per position attended to by a scheduled row (decode attention reads the context);
- ``c_attn``: per (chunk token x position) of a prefill chunk, attention's quadratic part;
- ``c_new``: per request the runner sees for the first time (its state built);
- ``period - dur``: the busy loop's work between two steps (outputs handed to clients,
  telemetry, inputs), per step and per request.

``dur`` is fitted on every step; the between-steps overhead on the steps that were followed at
once by another (``period`` set).

**Noise.** The same batch does not always take the same time: a real engine's step times have a
right tail (another process on the core, a page fault, the allocator), so their *mean* is above
the typical step, and throughput, queues and the ITL's tail follow the mean and the tail, not
the median. So the fit keeps the residual actual - fitted of every step of the trace, in
seconds, grouped by the fitted step's length (`Noise`), and the simulator adds to each step's
fitted time a residual drawn at random, with a fixed seed, from the steps of the trace nearest
its length: the trace's own spread, resampled. Residuals and not ratios: a stall of the core is
absolute, so a ratio taken on long steps understates it on a variant's shorter ones (a trace at
32 seats resampled onto 6-seat steps gave 4.7% too little step time, #44). ``ratios`` (actual /
fitted) stays as the summary the report prints. Fitting is least squares with the coefficients kept
non-negative (a feature whose coefficient would be negative is dropped and the rest refitted)
weighted by 1/duration (relative errors: short decode steps count as much as long prefill
ones), and robust to the odd slow step of a shared machine (residuals beyond 4 median absolute
deviations are dropped once and the fit repeated).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from vconsole.telemetry.request_trace import StepRecord

FEATURES = ("const", "python", "prefill", "decode", "context", "prefill_attn", "new_reqs")
OVERHEAD_FEATURES = ("const", "reqs")
MIN_STEPS = 30          # fewer busy steps than this: too little traffic to fit


NOISE_BINS = 8          # groups of steps by fitted length, each with its own residuals


class TooLittleTraffic(ValueError):
    """Not enough steps or requests to fit or check a model: say so, never guess."""


@dataclass
class Noise:
    """The fit's residuals (actual - fitted, seconds) grouped by the fitted step's length:
    ``edges[i]`` is the upper bound of group ``i`` (the last group has no bound). A step is
    given a residual of its own group, so a short decode step gets the stalls of short steps
    and a long prefill step those of long ones; a step shorter or longer than any the trace ran
    gets the nearest group's (absolute stalls: see the module docstring)."""

    edges: np.ndarray
    groups: list[np.ndarray]

    @classmethod
    def of(cls, fitted: np.ndarray, residuals: np.ndarray) -> Noise:
        order = np.argsort(fitted)
        parts = [p for p in np.array_split(order, min(NOISE_BINS, max(1, len(order) // 20)))
                 if len(p)]
        edges = np.array([float(fitted[p[-1]]) for p in parts[:-1]])
        return cls(edges, [residuals[p] for p in parts])

    def sampler(self, seed: int = 0, chunk: int = 65_536) -> Callable[[float], float]:
        """``draw(fitted) -> seconds``: the fitted time plus a residual of its group, never
        below a tenth of the fitted time; the same seed gives the same draws."""
        rng = np.random.default_rng(seed)
        edges, groups = self.edges.tolist(), self.groups
        uniform: list[float] = []

        def draw(fitted: float) -> float:
            if not uniform:
                uniform.extend(rng.random(chunk).tolist())
            g = groups[bisect_left(edges, fitted)]
            r = float(g[int(uniform.pop() * len(g))])
            return max(fitted + r, 0.1 * fitted)
        return draw


@dataclass
class StepCostModel:
    coef: dict[str, float]
    overhead: dict[str, float]
    num_steps: int
    rel_error: float = 0.0          # median |residual| / median dur of the fit
    notes: list[str] = field(default_factory=list)
    ratios: np.ndarray = field(default_factory=lambda: np.ones(1))   # actual / fitted, per step
    residuals: Noise | None = None          # None: no noise (a model built by hand)
    native_rows: int = 0        # pure-decode steps of 1 .. this many rows run natively

    def runs_native(self, prefill: int, decode: int) -> bool:
        """Whether the engine runs a step of this shape as one native call (its rule in
        `native_decode.NativeDecode.takes`, as far as a shape tells it)."""
        return prefill == 0 and 0 < decode <= self.native_rows

    def noise(self, seed: int = 0, chunk: int = 65_536) -> Iterator[float]:
        """Endless factors for successive steps, drawn from ``ratios``; the same seed gives
        the same factors (a summary of the spread; the simulator draws `sampler`'s)."""
        rng = np.random.default_rng(seed)
        while True:
            yield from self.ratios[rng.integers(0, len(self.ratios), chunk)].tolist()

    def sampler(self, seed: int = 0) -> Callable[[float], float]:
        """``draw(fitted) -> seconds``: a step's simulated time, its fitted time plus a
        residual of steps of its length (`Noise`); the fitted time alone without residuals."""
        if self.residuals is None:
            return lambda fitted: fitted
        return self.residuals.sampler(seed)

    def scaled(self, factor: float) -> StepCostModel:
        """This model with every cost (step, gap, residual) times ``factor``: the cost model's
        own uncertainty, as `vconsole.whatif.intervals` brackets it."""
        res = self.residuals
        return replace(self, coef={k: v * factor for k, v in self.coef.items()},
                       overhead={k: v * factor for k, v in self.overhead.items()},
                       residuals=None if res is None else
                       Noise(res.edges * factor, [g * factor for g in res.groups]))

    def dur(self, prefill: int, decode: int, context: int, prefill_attn: int,
            new_reqs: int, *, native: bool = False) -> float:
        c = self.coef
        return (c["const"] + (0.0 if native else c.get("python", 0.0))
                + c["prefill"] * prefill + c["decode"] * decode
                + c["context"] * context + c["prefill_attn"] * prefill_attn
                + c["new_reqs"] * new_reqs)

    def step_dur(self, s: StepRecord) -> float:
        """The fitted time of a recorded step, in the regime it ran."""
        return self.dur(s.prefill, s.decode, s.context, s.prefill_attn, s.new_reqs,
                        native=s.native)

    def gap(self, reqs: int) -> float:
        o = self.overhead
        return o["const"] + o["reqs"] * reqs

    def to_dict(self) -> dict[str, object]:
        r = self.ratios
        return {"coef": self.coef, "overhead": self.overhead, "num_steps": self.num_steps,
                "rel_error": round(self.rel_error, 4), "native_rows": self.native_rows,
                "noise": {"mean": round(float(r.mean()), 4),
                          "p90": round(float(np.percentile(r, 90)), 4),
                          "p99": round(float(np.percentile(r, 99)), 4)},
                "notes": self.notes}


def _rows(steps: list[StepRecord], regimes: bool) -> np.ndarray:
    """The features of each step; ``python`` is 0 throughout without ``regimes`` (a trace with
    no native step: the column would be the constant's, which the weighting hides from
    `_nnls`'s check for columns that never vary)."""
    return np.array([(1.0, float(regimes and not s.native), s.prefill, s.decode, s.context,
                      s.prefill_attn, s.new_reqs) for s in steps], dtype=np.float64)


def fit(steps: list[StepRecord], native_rows: int = 0) -> StepCostModel:
    """The model of these steps; ``native_rows``: the widest pure-decode step their engine ran
    natively (the trace header's ``native_decode_rows``), which the simulation's steps follow.
    Raises `TooLittleTraffic` with fewer than `MIN_STEPS` that computed something."""
    busy = [s for s in steps if s.prefill + s.decode > 0]
    if len(busy) < MIN_STEPS:
        raise TooLittleTraffic(f"too little traffic to fit step costs: {len(busy)} steps that "
                               f"computed tokens (need {MIN_STEPS})")
    # The "python" term only with enough steps of each regime to tell them apart (one native
    # step among thousands would make its split from the constant noise); else no term.
    num_native = sum(1 for s in busy if s.native)
    regimes = min(num_native, len(busy) - num_native) >= MIN_STEPS
    X = _rows(busy, regimes)
    y = np.array([s.dur for s in busy])
    # Relative residuals (each row over its duration): a 30 ms decode step weighs as much as a
    # 200 ms prefill one, so the many short steps that make the ITL are not fitted for the few
    # long ones.
    w = 1.0 / np.maximum(y, 1e-6)
    beta, used = _nnls_robust(X * w[:, None], y * w)
    coef = dict(zip(FEATURES, (float(b) for b in beta), strict=True))
    pred = X @ beta
    rel = float(np.median(np.abs(pred - y)) / max(np.median(y), 1e-9))
    ratios = np.clip(y / np.maximum(pred, 1e-9), 0.05, 50.0)
    residuals = Noise.of(pred, y - pred)
    notes = [f"{name} dropped (no effect measurable)" for name, u in zip(FEATURES, used,
                                                                           strict=True)
             if not u and name != "const" and (name != "python" or regimes)]

    chained = [s for s in busy if s.period is not None and s.period >= s.dur]
    if len(chained) >= MIN_STEPS // 2:
        Xo = np.array([(1.0, s.reqs) for s in chained])
        yo = np.array([s.period - s.dur for s in chained])   # type: ignore[operator]
        bo, _ = _nnls(Xo, yo)        # the mean: every gap of the loop adds up
        overhead = {"const": float(bo[0]), "reqs": float(bo[1])}
    else:
        overhead = {"const": 0.0, "reqs": 0.0}
        notes.append("no back-to-back steps: the busy loop's work between steps is taken as 0")
    return StepCostModel(coef, overhead, len(busy), rel, notes, ratios, residuals,
                         native_rows if regimes else 0)


def _nnls_robust(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, list[bool]]:
    beta, used = _nnls(X, y)
    resid = y - X @ beta
    mad = float(np.median(np.abs(resid - np.median(resid))))
    if mad > 0:
        keep = np.abs(resid) <= 4 * 1.4826 * mad
        if keep.sum() >= max(X.shape[1] * 3, len(y) // 2):
            beta, used = _nnls(X[keep], y[keep])
    return beta, used


def _nnls(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, list[bool]]:
    """Least squares with every coefficient >= 0, by dropping the most negative one until
    none is (the constant always stays). Columns that never vary are dropped first."""
    n = X.shape[1]
    used = [True] + [bool(np.ptp(X[:, j]) > 0) for j in range(1, n)]
    while True:
        cols = [j for j in range(n) if used[j]]
        # Scale columns so the solve is well conditioned (features span 1 .. 1e7).
        scale = np.maximum(np.abs(X[:, cols]).max(axis=0), 1e-12)
        sol, *_ = np.linalg.lstsq(X[:, cols] / scale, y, rcond=None)
        sol = sol / scale
        beta = np.zeros(n)
        beta[cols] = sol
        negative = [(beta[j], j) for j in cols if j != 0 and beta[j] < 0]
        if not negative:
            beta[0] = max(beta[0], 0.0)
            return beta, used
        used[min(negative)[1]] = False
