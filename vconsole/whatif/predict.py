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

from typing import Any

from vconsole.shared.config import ConfigError, EngineConfig, coerce_value
from vconsole.shared.config import canonical_kv_cache_dtype as canonical
from vconsole.telemetry.request_trace import FIGURES, Trace, figures, finished_normally
from vconsole.whatif.cost_model import StepCostModel, TooLittleTraffic, fit
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

    def __init__(self, trace: Trace, costs: Trace | None = None) -> None:
        h = trace.header
        if h.source == "csv" and costs is None:
            raise TooLittleTraffic("a CSV trace has no step records: give a vconsole trace "
                                   "of this model for the step costs (--costs FILE)")
        reason = check_traffic(trace)
        if reason:
            raise TooLittleTraffic(reason)
        source = costs or trace
        self.model: StepCostModel = fit(source.steps)
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
        bpt = self._bytes_per_token(dtype)
        pool_bytes = self.num_kv_blocks * self.block_size * (self.bytes_per_token or 1)
        if "num_kv_blocks" in values:
            blocks = int(values["num_kv_blocks"])
        elif "kv_cache_memory_bytes" in values:
            if not bpt:
                raise ValueError("kv_cache_memory_bytes: the trace does not say its KV bytes "
                                 "per token")
            blocks = int(values["kv_cache_memory_bytes"]) // (B * bpt)
        else:
            blocks = pool_bytes // (B * (bpt or 1))
        if blocks < 1:
            raise ValueError(f"the variant leaves the pool {blocks} blocks")
        restart: dict[str, Any] = {k: values[k] for k in ("block_size", "kv_cache_dtype")
                                   if k in values}
        config = config_replace(self.config, {**sched, **restart})
        return config, blocks

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

    def run(self, values: dict[str, Any]) -> SimResult:
        config, blocks = self.sized(values)
        changes = [(t, config_replace(c, {k: v for k, v in values.items()
                                          if k in SCHEDULER_KEYS}))
                   for t, c in self.changes]
        return simulate(self.trace, config, blocks, self.model,
                        max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                        config_changes=changes)


def predicted(result: SimResult) -> dict[str, Any]:
    """The figures over the requests that ran to their end, as `observed` counts them; the
    ones a variant's ``max_holding_seconds`` timed out are counted apart (``timed_out``)."""
    done = [r for r in result.requests if finished_normally(r)]
    out = figures(done, result.steps, result.num_kv_blocks)
    out["timed_out"] = sum(1 for r in result.requests if r.finish_reason == "timeout")
    out["num_kv_blocks"] = result.num_kv_blocks
    out["fragmentation_mean"] = round(result.fragmentation_mean, 4)
    out["rejected"] = result.rejected
    out["sim_s"] = round(result.sim_seconds, 3)
    return out


def observed(trace: Trace) -> dict[str, Any]:
    done = [r for r in trace.requests if finished_normally(r)]
    return figures(done, trace.steps, trace.header.num_kv_blocks)


def errors(pred: dict[str, Any], obs: dict[str, Any]) -> dict[str, float | None]:
    """Relative error of each figure (predicted - observed) / observed; preemptions and the
    KV peak, which may be 0, as an absolute difference over max(observed, 1)."""
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


def config_view(base: Baseline, values: dict[str, Any]) -> dict[str, Any]:
    config, blocks = base.sized(values)
    view = {k: getattr(config, k) for k in SCHEDULER_KEYS + ("block_size", "kv_cache_dtype")}
    view["num_kv_blocks"] = blocks
    return view


def whatif(trace: Trace, variants: list[dict[str, Any]], *,
           costs: Trace | None = None) -> dict[str, Any]:
    """The what-if report: ``{"baseline": {"config", "observed", "predicted", "error"},
    "variants": [{"set", "config", "predicted", "change"}], "model": ...}``. ``change``: each
    figure's predicted value over the predicted baseline's (the model's own bias cancels)."""
    base = Baseline(trace, costs)
    base_pred = predicted(base.run({}))
    report: dict[str, Any] = {
        "trace": {"requests": len(trace.requests), "steps": len(trace.steps),
                  "duration_s": round(trace.duration_s, 3), "model": trace.header.model},
        "model": base.model.to_dict(),
        "baseline": {"config": config_view(base, {}), "predicted": base_pred},
        "variants": [],
    }
    if trace.header.source != "csv":
        obs = observed(trace)
        report["baseline"]["observed"] = obs
        report["baseline"]["error"] = errors(base_pred, obs)
    for values in variants:
        pred = predicted(base.run(values))
        report["variants"].append({
            "set": values, "config": config_view(base, values), "predicted": pred,
            "change": {k: (round(pred[k] / base_pred[k], 4) if pred.get(k) is not None
                           and base_pred.get(k) else None) for k in FIGURES}})
    return report


__all__ = ["MODELLED", "Baseline", "TooLittleTraffic", "check_key", "check_traffic", "errors",
           "observed", "parse_assignments", "predicted", "whatif"]
