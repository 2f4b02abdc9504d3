"""What-if: the trace's own config replayed (the baseline, checked against what the trace
observed) and each variant replayed, through `vconsole.whatif.simulate`.

A variant is a mapping of config keys to values, validated as the engine validates a change.
Only the keys the scheduler or the KV pool honour can be predicted (`MODELLED`); any other key
is refused with the reason, never ignored. Capacity keys change the pool as the engine would
size it from the same memory: ``block_size`` keeps the pool's bytes (more, smaller blocks or
fewer, larger ones), ``kv_cache_dtype`` divides the same bytes by the new format's bytes per
token (capacity only: the step-time model is the trace's), ``kv_cache_memory_bytes`` and
``num_kv_blocks`` size it directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vconsole.shared.config import ConfigError, EngineConfig, coerce_value
from vconsole.shared.config import canonical_kv_cache_dtype as canonical
from vconsole.telemetry.request_trace import (
    FIGURES,
    StepRecord,
    Trace,
    figures,
    finished_normally,
)
from vconsole.whatif.calibration import level_factor, scaled
from vconsole.whatif.cost_model import StepCostModel, TooLittleTraffic, fit
from vconsole.whatif.coverage import Coverage
from vconsole.whatif.intervals import interval, interval_runs, shape_error
from vconsole.whatif.overload import verdict
from vconsole.whatif.simulate import SimResult, config_replace, engine_config, simulate

# Keys a simulation honours: the scheduler's (hot) and the pool's (capacity).
SCHEDULER_KEYS = ("max_num_seqs", "max_num_batched_tokens", "policy", "hybrid_aging_s",
                  "max_holding_seconds", "enable_prefix_caching")
CAPACITY_KEYS = ("num_kv_blocks", "block_size", "kv_cache_dtype", "kv_cache_memory_bytes")
MODELLED = SCHEDULER_KEYS + CAPACITY_KEYS
MIN_REQUESTS = 20        # fewer finished requests than this: too little traffic to judge


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["K=V", "K=V,K=V"]`` -> {K: value}, each checked against the config table and
    `MODELLED`. Raises ValueError naming the bad item."""
    out: dict[str, Any] = {}
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            key, eq, raw = part.partition("=")
            key = key.strip()
            if not eq:
                raise ValueError(f"{part!r}: expected KEY=VALUE")
            out[key] = check_key(key, raw.strip())
    if not out:
        raise ValueError("a variant needs at least one KEY=VALUE")
    return out


def check_key(key: str, value: Any) -> Any:
    """The value in its type, or ValueError: an unknown key, a bad value, or a key whose
    effect a simulation cannot predict."""
    value = coerce_value(key, value)
    if value is None and key in CAPACITY_KEYS:
        raise ValueError(f"{key}: give a value (unset means 'sized from memory', which a "
                         f"what-if cannot know)")
    if key not in MODELLED:
        raise ValueError(f"{key}: not predicted (a what-if models {', '.join(MODELLED)}; "
                         f"{key} changes neither scheduling nor the pool's capacity)")
    return value


def check_traffic(trace: Trace) -> str | None:
    """Why ``trace`` is too little to predict from (None when it is enough)."""
    done = sum(1 for r in trace.requests if finished_normally(r))
    busy = sum(1 for s in trace.steps if s.prefill + s.decode > 0)
    if done < MIN_REQUESTS:
        return (f"too little traffic: {done} finished requests (need {MIN_REQUESTS}) over "
                f"{trace.duration_s:.0f} s")
    if trace.steps and busy < 30:
        return f"too little traffic: {busy} steps that computed tokens (need 30)"
    return None


class Baseline:
    """The trace's own engine: its config, pool and the fitted step-time model."""

    def __init__(self, trace: Trace, costs: Trace | None = None,
                 calibration: Trace | None = None) -> None:
        h = trace.header
        if h.source == "csv" and costs is None:
            raise TooLittleTraffic("a CSV trace has no step records: give a vconsole trace "
                                   "of this model for the step costs (--costs FILE)")
        reason = check_traffic(trace)
        if reason:
            raise TooLittleTraffic(reason)
        source = costs or trace
        mismatch = None
        if calibration is not None:
            check_calibration(calibration, source)
            a, b = calibration.header.native_decode_rows, source.header.native_decode_rows
            if a != b:
                # The trace's engine is the one predicted: the calibration's steps are fitted
                # in its regime (theirs may have run natively where its would not).
                mismatch = (f"the calibration's engine ran decode steps of up to {a} rows "
                            f"natively, the trace's up to {b}: its steps fitted in the trace's "
                            f"regime (calibrate on the trace's engine for exact step costs)")
                calibration = Trace(calibration.header, calibration.requests, [
                    replace(s, native=s.native and s.decode <= b) for s in calibration.steps])
        # The steps the step-time model is fitted on: the trace's own, and a calibration's
        # grid of shapes when there is one (`vconsole whatif --calibrate`).
        # Its level: how much slower the trace ran than the calibration (1.0 without one).
        self.level = level_factor(source.steps, calibration.steps) if calibration else 1.0
        self.fit_steps: list[StepRecord] = source.steps + (
            scaled(calibration.steps, self.level) if calibration else [])
        self.calibrated = calibration is not None
        # The widest step the trace's engine ran natively.
        self.model: StepCostModel = fit(self.fit_steps, source.header.native_decode_rows)
        if mismatch:
            self.model.notes.append(mismatch)
        self.coverage = Coverage.of(self.fit_steps)
        sh = source.header
        self.trace = trace
        try:
            self.config = engine_config(h.config or sh.config)
        except ConfigError as e:
            raise ValueError(f"the trace's config is not valid here: {e}") from e
        blocks = h.num_kv_blocks or sh.num_kv_blocks
        if not blocks:
            raise ValueError("the trace does not say how many KV blocks its pool had")
        self.num_kv_blocks: int = int(blocks)
        self.block_size = self.config.block_size
        self.max_model_len = h.max_model_len or sh.max_model_len or 1 << 20
        self.vocab_size = h.vocab_size or sh.vocab_size or 32000
        self.bytes_per_token = h.kv_bytes_per_token or sh.kv_bytes_per_token
        self.by_dtype = h.kv_bytes_per_token_by_dtype or sh.kv_bytes_per_token_by_dtype
        self.block_bytes = h.kv_block_bytes_by_dtype or sh.kv_block_bytes_by_dtype
        self.dtype = canonical(self.config.kv_cache_dtype)
        # Hot changes the engine applied while the trace ran, replayed at their times.
        self.changes: list[tuple[float, EngineConfig]] = []
        for version, when in sorted(trace.config_times.items(), key=lambda x: x[1]):
            if version != h.config_version and version in trace.configs:
                self.changes.append((when, engine_config(trace.configs[version])))

    def sized(self, values: dict[str, Any]) -> tuple[EngineConfig, int]:
        """The config and pool size of a variant (`MODELLED` keys only)."""
        sched = {k: v for k, v in values.items() if k in SCHEDULER_KEYS}
        B = values.get("block_size", self.block_size)
        dtype = canonical(values.get("kv_cache_dtype", self.dtype))
        per_block = self._bytes_per_block(dtype, B)
        if "num_kv_blocks" in values:
            blocks = int(values["num_kv_blocks"])
        elif "kv_cache_memory_bytes" in values:
            if not per_block:
                raise ValueError("kv_cache_memory_bytes: the trace does not say its KV bytes "
                                 "per token")
            blocks = int(values["kv_cache_memory_bytes"]) // per_block   # as the engine does
        else:       # the pool's bytes in the variant's blocks (tokens, when bytes are unknown)
            own = self._bytes_per_block(self.dtype, self.block_size) or self.block_size
            blocks = self.num_kv_blocks * own // (per_block or B)
        if blocks < 1:
            raise ValueError(f"the variant leaves the pool {blocks} blocks")
        restart: dict[str, Any] = {k: values[k] for k in ("block_size", "kv_cache_dtype")
                                   if k in values}
        config = config_replace(self.config, {**sched, **restart})
        return config, blocks

    def _bytes_per_block(self, dtype: str, block_size: int) -> int | None:
        """A block's bytes in ``dtype``: exact from the trace's per-token and per-block parts
        (a per-channel format's parameters are per block, so its bytes per token depend on
        the block size), else ``block_size`` x its bytes per token (an older trace)."""
        parts = self.block_bytes.get(dtype)
        if parts:
            return block_size * int(parts[0]) + int(parts[1])
        bpt = self._bytes_per_token(dtype)
        return None if bpt is None else block_size * bpt

    def _bytes_per_token(self, dtype: str) -> int | None:
        if dtype == self.dtype:
            return self.bytes_per_token
        if not self.bytes_per_token:
            raise ValueError(f"kv_cache_dtype={dtype}: the trace does not say its own KV bytes "
                             f"per token")
        bpt = self.by_dtype.get(dtype)
        if bpt is None:
            raise ValueError(f"kv_cache_dtype={dtype}: the trace does not say this model's KV "
                             f"bytes per token in {dtype}")
        return int(bpt)

    def run(self, values: dict[str, Any], *, model: StepCostModel | None = None,
            seed: int = 0, trace: Trace | None = None) -> SimResult:
        """The variant ``values`` simulated on the trace (or on ``trace``: the same requests
        otherwise timed, `vconsole.whatif.overload.saturated`), with this baseline's model
        (or ``model``) and noise seed."""
        config, blocks = self.sized(values)
        model = model or self.model
        if canonical(config.kv_cache_dtype) != "auto" and model.native_rows:
            model = replace(model, native_rows=0)   # a quantized pool: every step in Python
        changes = [] if trace is not None else [
            (t, config_replace(c, {k: v for k, v in values.items() if k in SCHEDULER_KEYS}))
            for t, c in self.changes]
        return simulate(trace or self.trace, config, blocks, model,
                        max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                        config_changes=changes, seed=seed)


def check_calibration(calibration: Trace, trace: Trace) -> None:
    """A calibration measured on another model (or block size) than the trace cannot time it:
    ValueError with both names."""
    a, b = calibration.header, trace.header
    if a.model and b.model and a.model != b.model:
        raise ValueError(f"the calibration was measured on {a.model!r}, the trace on "
                         f"{b.model!r}: one model's step costs cannot time another's")
    if not [s for s in calibration.steps if s.prefill + s.decode > 0]:
        raise ValueError("the calibration holds no step that computed tokens")


def _kv_peak_blocks(steps: list[StepRecord]) -> int | None:
    """The most KV blocks in use at one step (``kv_usage_peak`` in blocks)."""
    return max((s.kv_used for s in steps), default=None)


def predicted(result: SimResult) -> dict[str, Any]:
    """The figures over the requests that ran to their end, as `observed` counts them; the
    ones a variant's ``max_holding_seconds`` timed out are counted apart (``timed_out``)."""
    done = [r for r in result.requests if finished_normally(r)]
    out = figures(done, result.steps, result.num_kv_blocks)
    out[KV_BLOCKS] = _kv_peak_blocks(result.steps)
    out["timed_out"] = sum(1 for r in result.requests if r.finish_reason == "timeout")
    out["num_kv_blocks"] = result.num_kv_blocks
    out["fragmentation_mean"] = round(result.fragmentation_mean, 4)
    out["rejected"] = result.rejected
    out["sim_s"] = round(result.sim_seconds, 3)
    return out


def observed(trace: Trace) -> dict[str, Any]:
    """The figures the trace recorded, with its pool: ``kv_peak_blocks`` of
    ``num_kv_blocks``."""
    done = [r for r in trace.requests if finished_normally(r)]
    out = figures(done, trace.steps, trace.header.num_kv_blocks)
    out[KV_BLOCKS] = _kv_peak_blocks(trace.steps)
    out["num_kv_blocks"] = trace.header.num_kv_blocks
    return out


def errors(pred: Mapping[str, Any], obs: Mapping[str, Any]) -> dict[str, float | None]:
    """Relative error of each figure (predicted - observed) / observed; preemptions, which may
    be 0, as the difference over max(observed, 1); any other figure observed as 0 has no
    relative error (None) unless it is predicted 0 too."""
    out: dict[str, float | None] = {}
    for k in FIGURES:
        p, o = pred.get(k), obs.get(k)
        if p is None or o is None:
            out[k] = None
        elif k in ("preemptions",):
            out[k] = round((p - o) / max(o, 1), 4)
        elif o == 0:
            out[k] = 0.0 if p == 0 else None
        else:
            out[k] = round((p - o) / o, 4)
    return out


# --- saying what it knows: the figures' names, changes, and the baseline's own error ----------

LABELS = {"output_tok_s": "output tok/s", "ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99",
          "itl_p50_s": "ITL p50", "itl_p99_s": "ITL p99", "e2e_p50_s": "e2e p50",
          "preemptions": "preemptions", "kv_usage_peak": "KV peak"}


KV_BLOCKS = "kv_peak_blocks"    # the KV peak in blocks of its pool, reported beside FIGURES
ROWS = (*FIGURES, KV_BLOCKS)     # a report's rows, as the CLI and the console show them
ROW_LABELS = {**LABELS, "kv_usage_peak": "KV peak, % pool", KV_BLOCKS: "KV peak, blocks"}


def _as_shown(x: float) -> float:
    """``x`` (a fraction) at the precision `pct` shows it: 0.1% under 10%, 1% above."""
    return round(x, 3) if abs(x) < 0.0995 else round(x, 2)


def pct(x: float | None) -> str:
    """A fraction as a signed percentage: ``+68%``, ``-0.5%``, ``+3,489%``, ``0%``; ``-`` for
    None."""
    if x is None:
        return "-"
    x = _as_shown(x)
    if x == 0:
        return "0%"
    return f"{x:+.1%}" if abs(x) < 0.0995 else f"{x * 100:+,.0f}%"


def tolerance(model_error: float) -> str:
    """The model's stated error as the reports say it: ``±8.1%``, ``±52%``."""
    return "±" + pct(model_error).lstrip("+")


def rough(error: Mapping[str, float | None],
          stated: float | Mapping[str, float | None]) -> list[str]:
    """The figures whose predicted baseline misses what the trace observed by more than the
    model's stated error, compared as both are shown (`pct`, `tolerance`): a prediction of
    such a figure is rough, whatever the change. ``stated``: one error for every figure (the
    step-time model's median error per step), or one per figure (each figure's interval,
    `vconsole.whatif.intervals`; a figure without one is judged by none)."""
    out = []
    for k in FIGURES:
        e = error.get(k)
        limit = stated.get(k) if isinstance(stated, Mapping) else stated
        if e is not None and limit is not None and abs(_as_shown(e)) > abs(_as_shown(limit)):
            out.append(k)
    return out


def rough_note(key: str, error: float, stated: float | None = None) -> str:
    """``TTFT p99 by +68%: treat predicted TTFT p99 as rough`` (with ``stated``: ``TTFT p99
    by +68%, stated ±12%: ...``), under `rough_heading`."""
    name = LABELS.get(key, key)
    within = "" if stated is None else f", stated {tolerance(stated)}"
    return f"{name} by {pct(error)}{within}: treat predicted {name} as rough"


def rough_heading(model_error: float | None, baseline: str = "the baseline") -> str:
    """``the model misses the baseline by more than its stated ±8.1% on:`` (None: each
    figure's own stated error, given in its note)."""
    if model_error is None:
        return f"the model misses {baseline} by more than its stated error on:"
    return f"the model misses {baseline} by more than its stated {tolerance(model_error)} on:"


def change_rel(pred: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    """Each figure's change against the predicted baseline, ``pred / base - 1`` (None where
    either is missing or the baseline is 0): both simulated, so the model's bias cancels."""
    return {k: (round(pred[k] / base[k] - 1, 4) if pred.get(k) is not None and base.get(k)
                else None) for k in FIGURES}


def config_view(base: Baseline, values: dict[str, Any]) -> dict[str, Any]:
    config, blocks = base.sized(values)
    view = {k: getattr(config, k) for k in SCHEDULER_KEYS + ("block_size", "kv_cache_dtype")}
    view["num_kv_blocks"] = blocks
    return view


def assess(base: Baseline, values: dict[str, Any], result: SimResult, pred: dict[str, Any],
           cost_error: Mapping[str, float] | None) -> dict[str, Any]:
    """What a prediction knows of itself: ``coverage`` (the share of its steps outside the
    shapes the model was fitted on), ``overload`` (the verdict and the capacity), and with
    ``cost_error`` (`shape_error`) ``interval`` (each figure's bounds and stated error,
    `vconsole.whatif.intervals`)."""
    out: dict[str, Any] = {"coverage": base.coverage.outside(result.steps)}
    error = (cost_error["outside" if out["coverage"]["warn"] else "inside"]
             if cost_error is not None else 0.0) or base.model.rel_error
    out["overload"] = verdict(base.trace, lambda t: base.run(values, trace=t), result,
                              margin=error)
    if cost_error is not None:
        runs = interval_runs(lambda m, seed: predicted(base.run(values, model=m, seed=seed)),
                             base.model, error)
        out["interval"] = {**interval(pred, runs), "cost_error": error}
    return out


def whatif(trace: Trace, variants: list[dict[str, Any]], *,
           costs: Trace | None = None, calibration: Trace | None = None,
           intervals: bool = True) -> dict[str, Any]:
    """The what-if report: ``{"baseline": {"config", "observed", "predicted", "error",
    "rough", ...}, "variants": [{"set", "config", "predicted", "change", "change_rel",
    "rough", ...}], "model": ...}``. ``change``: each figure's predicted value over the
    predicted baseline's (the model's own bias cancels); ``change_rel`` the same less one
    (-0.2: 20% less). ``error``: the predicted baseline against what the trace observed, per
    figure; ``rough``: the figures where that error is beyond the stated one (each figure's
    interval with ``intervals``, else the step-time model's ``model.rel_error``), so every
    prediction of them is rough (empty, and no ``error``, for a CSV trace: nothing observed
    to check against). Each entry also has ``coverage``, ``overload`` and (``intervals``)
    ``interval``: `assess`. ``calibration``: a `--calibrate` run's steps, fitted with the
    trace's."""
    base = Baseline(trace, costs, calibration)
    cost_error = shape_error(base.fit_steps, base.model) if intervals else None
    if cost_error is not None and base.calibrated:
        # The machine's level moved between the trace and the calibration by this much: a
        # later run may be at either, so it counts in the step costs' error.
        drift = abs(1.0 - base.level)
        cost_error = {k: round(math.hypot(v, drift), 4) for k, v in cost_error.items()}
    base_run = base.run({})
    base_pred = predicted(base_run)
    model = base.model.to_dict()
    model["calibrated"] = base.calibrated
    if base.calibrated:
        model["calibration_level"] = round(base.level, 4)
    if cost_error is not None:
        model["shape_error"] = cost_error
    report: dict[str, Any] = {
        "trace": {"requests": len(trace.requests), "steps": len(trace.steps),
                  "duration_s": round(trace.duration_s, 3), "model": trace.header.model},
        "model": model,
        "baseline": {"config": config_view(base, {}), "predicted": base_pred,
                     **assess(base, {}, base_run, base_pred, cost_error)},
        "variants": [],
    }
    stated: float | dict[str, float | None] = base.model.rel_error
    if "interval" in report["baseline"]:
        stated = report["baseline"]["interval"]["stated"]
    if trace.header.source != "csv":
        obs = observed(trace)
        report["baseline"]["observed"] = obs
        report["baseline"]["error"] = errors(base_pred, obs)
    flagged = rough(report["baseline"].get("error", {}), stated)
    report["baseline"]["rough"] = flagged
    for values in variants:
        result = base.run(values)
        pred = predicted(result)
        report["variants"].append({
            "set": values, "config": config_view(base, values), "predicted": pred,
            "change": {k: (round(pred[k] / base_pred[k], 4) if pred.get(k) is not None
                           and base_pred.get(k) else None) for k in FIGURES},
            "change_rel": change_rel(pred, base_pred), "rough": list(flagged),
            **assess(base, values, result, pred, cost_error)})
    return report


__all__ = ["KV_BLOCKS", "LABELS", "MODELLED", "ROWS", "ROW_LABELS", "Baseline", "TooLittleTraffic",
           "assess", "change_rel", "check_calibration", "check_key",
           "check_traffic", "errors", "observed", "parse_assignments", "pct", "predicted",
           "rough", "rough_heading", "rough_note", "tolerance", "whatif"]
