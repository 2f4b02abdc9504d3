"""What-if in the console: the engine's recent traffic, and what a config change would do to it.

The engine keeps the last minutes of its request trace in memory and hands it over the control
channel (``get_trace``, `vconsole.console.control_link.ControlLink.get_trace`). `WhatIf` fetches
it, parses it and keeps it for `TRACE_MAX_AGE_S`, so the confirmation box, the Advice rows and
the What-if screen asked within seconds of each other share one fetch. The simulation
(`vconsole.whatif.predict`: the engine's own scheduler and KV cache manager on a virtual clock,
each step timed by a model fitted on the trace's own steps) runs here, in the console's
process, never on the engine.

Threads: `WhatIf.predict` and `WhatIf.trace` block (a fetch, seconds of simulation): the app
runs them in Textual thread workers (`VConsoleApp.predict_later`). One simulation at a time
(a lock: two on a two-core machine only halve each other). What was predicted on the trace in
hand is kept, so a second ask for the same change (the confirmation box of an advice the Advice
screen already predicted) is answered at once (`peek`).

Honesty about its own error: each prediction carries the trace's observed figures (``live``)
beside the simulated "now", so the model's miss on this very traffic is shown per figure
(`Prediction.error`), and an interval per figure (`vconsole.whatif.intervals`: the noise
reseeded, the step costs moved by their error); a figure "now" misses by more than its
interval is rough on every prediction of it (`Prediction.rough`, marked `MARK`). A change
that serves fewer requests per second than arrive says so first, with its capacity, and its
waits read "grows" (`vconsole.whatif.overload`).

The step costs are fitted on the trace and on the newest calibration of an engine like the
watched one, when there is one (`vconsole.console.calibrating`: `TraceInfo.calibration` says
which); `WhatIf.calibrate` runs a new one (``vconsole whatif --calibrate``, its own engine).

Honesty, never a guess: a change with a key no simulation models is "not predicted" with the
reason (`vconsole.whatif.predict.check_key`); a trace with too little traffic says "too little
traffic to predict" and why (`check_traffic`, `TooLittleTraffic`); a source without a control
channel (a vLLM server, a replayed recording) says `NO_CHANNEL`.

No Textual here: the formatting below returns Content markup strings.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vconsole.console import format as fmt
from vconsole.console.calibrating import NO_CALIBRATION, Calibrator, Outcome, pick
from vconsole.telemetry.request_trace import FIGURES, Trace, TraceError, parse_lines
from vconsole.whatif.calibration import calibrations_dir
from vconsole.whatif.intervals import shape_error
from vconsole.whatif.overload import verdict_line
from vconsole.whatif.predict import (
    KV_BLOCKS,
    LABELS,
    MODELLED,
    Baseline,
    TooLittleTraffic,
    assess,
    check_key,
    check_traffic,
    errors,
    observed,
    pct,
    predicted,
    rough,
    tolerance,
)

NO_CHANNEL = "what-if needs a vconsole engine's control channel"
TRACE_MAX_AGE_S = 10.0

# The figures the confirmation box and the Advice detail show (the What-if screen shows
# FIGURES); an Advice row, 48 columns, the three of ROW.
SHOWN = ("output_tok_s", "ttft_p99_s", "itl_p99_s", "preemptions")
ROW = ("output_tok_s", "ttft_p99_s", "preemptions")
MARK = "!"                       # beside a prediction of a figure "now" misses live by more
                                 # than the step-time model's stated error (`Prediction.rough`)
SHORT = {"output_tok_s": "tok/s", "ttft_p99_s": "TTFT p99", "itl_p99_s": "ITL p99",
         "preemptions": "preempt"}


PENDING, READY, NOT_PREDICTED, TOO_LITTLE, UNAVAILABLE, FAILED = (
    "pending", "ready", "not predicted", "too little traffic", "unavailable", "failed")

Change = Mapping[str, Any]


@dataclass(frozen=True)
class TraceInfo:
    """What the prediction stands on: the trace's size and how well the step costs fit."""

    requests: int
    steps: int
    duration_s: float
    model_error: float | None = None     # the step-time model's median relative error
    calibration: str = NO_CALIBRATION    # which calibration the step costs stand on

    def describe(self) -> str:
        """``312 requests over 4.8 min``."""
        span = (f"{self.duration_s / 60:.1f} min" if self.duration_s >= 90
                else f"{self.duration_s:.0f} s")
        return f"{self.requests:,} requests over {span}"


@dataclass(frozen=True)
class Prediction:
    """One change's predicted effect: ``before`` (the trace's own config, simulated), ``after``
    (the change, simulated), ``live`` (what the trace observed); or a status with the reason
    it holds no figures."""

    status: str
    change: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)
    trace: TraceInfo | None = None
    # What each side knows of itself (`vconsole.whatif.predict.assess`): ``interval``
    # (bounds and stated error per figure), ``overload`` (the verdict, the capacity) and
    # ``coverage`` (the share of its steps outside the fitted shapes).
    before_info: dict[str, Any] = field(default_factory=dict)
    after_info: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.status == READY

    @property
    def stated(self) -> dict[str, float | None]:
        """Each figure's stated error on "now" (its interval's half-width), {} without."""
        return dict((self.before_info.get("interval") or {}).get("stated") or {})

    @property
    def after_stated(self) -> dict[str, float | None]:
        """Each figure's stated error on "after", {} without."""
        return dict((self.after_info.get("interval") or {}).get("stated") or {})

    @property
    def overloaded(self) -> bool:
        """The change serves fewer requests per second than the trace's arrive."""
        return bool((self.after_info.get("overload") or {}).get("overloaded"))

    @property
    def near_capacity(self) -> bool:
        """What arrives is within the model's error of what the change serves: the queue
        may grow (`vconsole.whatif.overload.verdict`)."""
        return bool((self.after_info.get("overload") or {}).get("near_capacity"))

    def overload_line(self) -> str:
        """``overloaded: this change serves 14.6 req/s (2,370 output tok/s), 19.8 arrive:
        ...``, or ``near capacity: ...`` (plain text; empty when it keeps up)."""
        return verdict_line("this change" if self.change else "the live config",
                            self.after_info.get("overload"))

    def coverage_line(self) -> str:
        """``62% of its steps at batch shapes never fitted (vconsole whatif --calibrate)``:
        the change runs batches the step-time model extrapolates to, its interval wider there
        (empty when covered)."""
        cov = self.after_info.get("coverage") or {}
        if not cov.get("warn"):
            return ""
        return (f"{cov['share']:.0%} of its steps at batch shapes never fitted "
                f"(vconsole whatif --calibrate)")

    @property
    def error(self) -> dict[str, float | None]:
        """How far "now" (the trace's own config, simulated) is from what the trace observed,
        per figure: the model's own error on this traffic (empty before figures)."""
        return errors(self.before, self.live) if self.ready and self.live else {}

    @property
    def rough(self) -> list[str]:
        """The figures "now" misses by more than the step-time model's stated error: every
        prediction of them is rough (`vconsole.whatif.predict.rough`)."""
        if self.stated:
            return rough(self.error, self.stated)
        if self.trace is None or self.trace.model_error is None:
            return []
        return rough(self.error, self.trace.model_error)

    def rough_line(self, width: int = 150) -> str:
        """``now misses live by more than the model's ±13% on TTFT p50 and TTFT p99: treat
        those predictions as rough`` (plain text; empty when none is). The figures are named
        while that fits ``width`` (their errors are beside them), else counted."""
        keys = self.rough
        if not keys:
            return ""
        names = [LABELS[k] for k in keys]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        which = "that prediction" if len(keys) == 1 else "those predictions"
        if self.stated:
            head = "now misses live by more than its interval on "
        elif self.trace is not None and self.trace.model_error is not None:
            head = (f"now misses live by more than the model's "
                    f"{tolerance(self.trace.model_error)} on ")
        else:
            return ""
        tail = f": treat {which} as rough"
        if len(head + listed + tail) > width:
            listed = f"{len(keys)} of {len(FIGURES)} figures (marked {MARK})"
        return head + listed + tail

    def headline(self) -> str:
        """What a status without figures says (plain text)."""
        if self.status == PENDING:
            return "predicting… (the engine's last minutes, simulated here)"
        if self.status == TOO_LITTLE:
            return f"too little traffic to predict: {self.reason}"
        if self.status == NOT_PREDICTED:
            return f"not predicted: {self.reason}"
        if self.status == UNAVAILABLE:
            return self.reason or NO_CHANNEL
        if self.status == FAILED:
            return f"no prediction: {self.reason}"
        return ""

    def short(self, keys: tuple[str, ...] = ROW) -> str:
        """One line (plain text): ``tok/s 52→48 · TTFT p99 3.9→2.1 s · preempt 26→3``, or the
        status alone (`headline` says why)."""
        if not self.ready:
            return {PENDING: "predicting…", TOO_LITTLE: "too little traffic to predict",
                    NOT_PREDICTED: "not predicted", UNAVAILABLE: "–"}.get(self.status,
                                                                          "no prediction")
        return " · ".join(f"{SHORT[k]} {before_after(k, self.before.get(k), self.after.get(k))}"
                          for k in keys)


def pending(change: Change) -> Prediction:
    return Prediction(PENDING, dict(change))


def unmodelled(change: Change) -> str | None:
    """Why ``change`` cannot be predicted (a key no simulation models, or a value the config
    table refuses), or None."""
    for key, value in change.items():
        if key not in MODELLED:
            return f"{key} changes neither scheduling nor the KV pool's capacity"
        try:
            check_key(key, value)
        except ValueError as e:
            return str(e)
    return None


def modelled(change: Change) -> bool:
    """Any key of ``change`` is one a simulation models (a box worth a prediction)."""
    return any(k in MODELLED for k in change)


_TOO_LITTLE = re.compile(r"^too little traffic( to [^:]*)?:\s*")


def _too_little(reason: str) -> str:
    return _TOO_LITTLE.sub("", reason)


def _key(change: Change) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in change.items()))


class WhatIf:
    """The console's what-if: ``fetch`` returns the engine's trace as JSON lines (None: no
    channel, every prediction `UNAVAILABLE` with ``unavailable`` as the reason)."""

    def __init__(self, fetch: Callable[[], str] | None, *, unavailable: str = NO_CHANNEL,
                 max_age_s: float = TRACE_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic, intervals: bool = True,
                 calibrations: Path | None = None) -> None:
        self.fetch = fetch
        self.calibrations = calibrations       # None: `calibrations_dir`, read at each fetch
        self.calibrator = Calibrator()
        self.intervals = intervals             # each prediction's interval (4 more runs)
        self.unavailable = unavailable
        self.max_age_s = max_age_s
        self.clock = clock
        self.fetches = 0                       # traces fetched (tests: the cache is shared)
        self._lock = threading.Lock()          # one fetch or simulation at a time
        self._trace: Trace | None = None
        self._info: TraceInfo | None = None
        self._error: Prediction | None = None  # the last fetch's failure, kept as long
        self._fetched_at = -1e18
        self._base: Baseline | None = None
        self._before: dict[str, Any] = {}
        self._before_info: dict[str, Any] = {}
        self._cost_error: dict[str, float] | None = None
        self._live: dict[str, Any] = {}
        self._memo: dict[tuple[tuple[str, str], ...], Prediction] = {}

    @property
    def available(self) -> bool:
        return self.fetch is not None

    @property
    def trace_info(self) -> TraceInfo | None:
        """The size of the trace last fetched (None before one was)."""
        return self._info

    def _fresh(self) -> bool:
        return self.clock() - self._fetched_at < self.max_age_s

    def peek(self, change: Change) -> Prediction | None:
        """The prediction for ``change`` on the trace in hand, if there is one (no blocking:
        the UI thread may ask)."""
        if not self._fresh():
            return None
        try:
            return self._memo.get(_key({k: check_key(k, v) for k, v in change.items()}))
        except ValueError:
            return None

    # --- blocking: worker threads only -------------------------------------------------------

    def _refresh(self) -> Prediction | None:
        """Fetch and parse the trace unless the one in hand is fresh; the failure that makes
        every prediction on it impossible, or None. Called under the lock."""
        if self._fresh():
            return self._error
        assert self.fetch is not None
        self._memo = {}
        self._base, self._before, self._live = None, {}, {}
        self._before_info, self._cost_error = {}, None
        self._error = None
        self._fetched_at = self.clock()
        try:
            text = self.fetch()
            self.fetches += 1
            trace = parse_lines(text.splitlines(keepends=True), "the engine's trace")
        except TraceError as e:
            self._trace, self._info = None, None
            if "no finished request" in str(e):
                self._error = Prediction(TOO_LITTLE, reason="no request finished in the "
                                         "engine's last minutes")
            else:
                self._error = Prediction(FAILED, reason=f"the engine's trace is unusable: {e}")
            return self._error
        except Exception as e:   # TimeoutError, ControlError (an engine without get_trace)
            self._trace, self._info = None, None
            self._error = Prediction(FAILED, reason=f"cannot fetch the engine's trace: {e}")
            return self._error
        self._trace = trace
        self._info = TraceInfo(len(trace.requests), len(trace.steps), trace.duration_s)
        reason = check_traffic(trace)
        if reason is not None:
            self._error = Prediction(TOO_LITTLE, reason=_too_little(reason), trace=self._info)
            return self._error
        calib, calibration = pick(trace, self.calibrations or calibrations_dir())
        try:
            self._base = Baseline(trace, calibration=calib)
            self._cost_error = (shape_error(self._base.fit_steps, self._base.model)
                                if self.intervals else None)
            if self._cost_error is not None and calib is not None:   # as `predict.whatif`
                drift = abs(1.0 - self._base.level)
                self._cost_error = {k: math.hypot(v, drift) for k, v in self._cost_error.items()}
            run = self._base.run({})
            self._before = predicted(run)
            self._before_info = assess(self._base, {}, run, self._before, self._cost_error)
        except TooLittleTraffic as e:
            self._error = Prediction(TOO_LITTLE, reason=_too_little(str(e)), trace=self._info)
            return self._error
        except ValueError as e:
            self._error = Prediction(FAILED, reason=str(e), trace=self._info)
            return self._error
        except Exception as e:   # a simulator bug: said, never a half-filled "now" column
            self._base, self._before = None, {}
            self._error = Prediction(FAILED, reason=f"the simulation failed: "
                                     f"{type(e).__name__}: {e}", trace=self._info)
            return self._error
        self._live = observed(trace)
        self._info = TraceInfo(len(trace.requests), len(trace.steps), trace.duration_s,
                               self._base.model.rel_error, calibration)
        return None

    def forget(self) -> None:
        """The next prediction fetches a trace (and picks its calibration) again."""
        self._fetched_at = -1e18

    def calibrate(self, variant: Change, progress: Callable[[str], None],
                  cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        """Calibrate the engine's trace for its config and ``variant`` (`Calibrator.run`);
        the next prediction uses it. Blocks for the whole probe: a worker thread."""
        if self.fetch is None:
            return Outcome(False, self.unavailable)
        with self._lock:
            failed = self._refresh()
            trace = self._trace
        if trace is None:
            return Outcome(False, failed.headline() if failed else "no trace to calibrate")
        done = self.calibrator.run(trace, self.calibrations or calibrations_dir(), variant,
                                   progress=progress, cancelled=cancelled)
        self.forget()
        return done

    def predict(self, changes: list[Change]) -> list[Prediction]:
        """Each change's prediction on the engine's recent trace (fetched when the one in hand
        is older than ``max_age_s``). Blocks: a worker thread."""
        if self.fetch is None:
            return [Prediction(UNAVAILABLE, dict(c), self.unavailable) for c in changes]
        out: list[Prediction] = []
        with self._lock:
            failed = self._refresh()
            for change in changes:
                out.append(self._one(dict(change), failed))
        return out

    def _one(self, change: dict[str, Any], failed: Prediction | None) -> Prediction:
        reason = unmodelled(change)
        if reason is not None:
            return Prediction(NOT_PREDICTED, change, reason)
        try:
            values = {k: check_key(k, v) for k, v in change.items()}
        except ValueError as e:
            return Prediction(NOT_PREDICTED, change, str(e))
        if failed is not None:
            return Prediction(failed.status, change, failed.reason, trace=failed.trace)
        key = _key(values)
        done = self._memo.get(key)
        if done is not None:
            return done
        assert self._base is not None
        try:
            if values:
                run = self._base.run(values)
                after = predicted(run)
                after_info = assess(self._base, values, run, after, self._cost_error)
            else:
                after, after_info = dict(self._before), dict(self._before_info)
        except ValueError as e:
            result = Prediction(NOT_PREDICTED, change, str(e), trace=self._info)
        except Exception as e:   # this change only: the batch's other predictions stand
            result = Prediction(FAILED, change, f"the simulation failed: "
                                f"{type(e).__name__}: {e}", trace=self._info)
        else:
            result = Prediction(READY, change, before=self._before, after=after,
                                live=self._live, trace=self._info,
                                before_info=self._before_info, after_info=after_info)
        self._memo[key] = result
        return result


# --- formatting (Content markup) -----------------------------------------------------------------

def figure(key: str, value: Any, pool: Any = None) -> str:
    """One figure in its unit: ``52.1`` tok/s, ``3.90 s`` / ``41 ms``, ``26``, ``85%`` (the KV
    peak, of the pool), ``424/8,192`` (`KV_BLOCKS`: the peak in blocks of a ``pool``)."""
    if value is None:
        return "–"
    if key == KV_BLOCKS:
        return f"{int(value):,}/{int(pool):,}" if pool else f"{int(value):,}"
    if key == "output_tok_s":
        return fmt.num(float(value), 1)
    if key.endswith("_s"):
        v = float(value)
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    if key == "kv_usage_peak":
        return f"{float(value):.0%}"
    return f"{int(value):,}"


def before_after(key: str, before: Any, after: Any) -> str:
    """``52.1→48.3``, ``3.9→2.1 s``, ``41→38 ms``: both sides in one unit, said once."""
    if before is None or after is None:
        return f"{figure(key, before)}→{figure(key, after)}"
    if key == "output_tok_s":
        return f"{float(before):.0f}→{float(after):.0f}"
    if key.endswith("_s"):
        b, a = float(before), float(after)
        if max(b, a) < 1:
            return f"{b * 1000:.0f}→{a * 1000:.0f} ms"
        if min(b, a) >= 1:
            return f"{b:.1f}→{a:.1f} s"
    return f"{figure(key, before)}→{figure(key, after)}"


def change_pct(before: Any, after: Any) -> str:
    """``-7%`` / ``+12%`` / ``+2,900%`` / ``=``: after against before, in %; empty when either
    is missing or before is 0."""
    if before is None or after is None:
        return ""
    if after == before:
        return "="
    if not before:
        return ""
    return pct(after / before - 1)


# Lower is better for every figure but throughput: a change's colour says which way it went.
_HIGHER_IS_BETTER = {"output_tok_s"}


def change_style(key: str, before: Any, after: Any) -> str:
    if before is None or after is None or before == after:
        return "$text-muted"
    better = (after > before) == (key in _HIGHER_IS_BETTER)
    return "$success" if better else "$warning"
