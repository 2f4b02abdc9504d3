"""Calibration: the grid of batch shapes a what-if's variants need, measured on the engine.

A trace holds the shapes its own config ran; a variant that cuts the seats to a fifth runs
shapes the trace barely has, and there the fitted step-time model extrapolates
(`vconsole.whatif.coverage`). `vconsole whatif TRACE --calibrate` closes that gap: it runs the
trace's model on an engine of its own through a short grid of probes (`grid`) and keeps that
engine's step records beside the trace (`calibration_path`: ``TRACE.calib.jsonl``, a request
trace like any other). Every later prediction on the trace fits its step-time model on the
trace's steps and the calibration's together (`vconsole.whatif.predict.Baseline`), so the
shapes the probes ran are covered; the calibration's steps are first brought to the trace's
level on the shapes both ran (`leveled`: the probe may run on a busier or quieter machine).

**The grid** is rows x context x prefill chunk:

- rows: 1, 2, 4, ... up to the most seats the trace or a variant gives, and each of those
  seat counts itself (a fifth of 32 is 6: 6 rows are probed);
- context: `CONTEXTS` tokens of prompt per row, each capped so the rows fit the pool and the
  model's length; every probe decodes `DECODE_STEPS` tokens, so its context grows that much;
- prefill chunk: one request of each of `CHUNKS` tokens and of each token budget the trace or
  a variant gives (a single chunk each, at the largest budget the probe engine runs with).

Each probe's requests are sent at once and awaited before the next probe: a probe never
shares a step with another, so its steps are the shape it names.

**The console's calibrations** (`stored_trace_path`, `newest`): the console's trace comes over
the control channel and lives nowhere, so the console writes it to `calibrations_dir` as
``MODEL-FINGERPRINT-STAMP.jsonl`` and runs ``vconsole whatif`` on it with ``--calibrate``; the
calibration lands beside it. A later prediction on an engine uses the newest calibration of
the same `fingerprint`: the model and the keys that set a step's cost (device, dtype,
quantization, block size, KV format). The scheduler keys and the pool are left out: they
change which shapes run, not what a shape costs, and the calibration grid measures shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vconsole.telemetry.request_trace import StepRecord, TraceHeader
from vconsole.whatif.cost_model import TooLittleTraffic, fit
from vconsole.whatif.coverage import busy

CONTEXTS = (24, 48, 96, 192, 384, 768)   # one per octave of context per row
CHUNKS = (16, 64)
DECODE_STEPS = 24
REPEATS = 2             # each probe twice: enough steps of each shape to count as covered
SUFFIX = ".calib.jsonl"
COST_KEYS = ("device", "dtype", "quantization", "block_size", "kv_cache_dtype")


@dataclass(frozen=True)
class Probe:
    """``rows`` requests of ``prompt_len`` tokens each, sent together, each generating
    ``output_len`` tokens."""

    rows: int
    prompt_len: int
    output_len: int


def calibration_path(trace_path: str | Path) -> Path:
    """Where a trace's calibration is kept: beside it, ``NAME.calib.jsonl``."""
    p = Path(trace_path)
    name = p.name[:-len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(name + SUFFIX)


def fingerprint(header: TraceHeader) -> str:
    """12 hex digits over the trace's model and `COST_KEYS`: equal for two engines whose
    steps of one shape cost the same."""
    cfg = header.config or {}
    keys = {k: cfg.get(k) for k in COST_KEYS} | {"model": header.model,
                                                  "block_size": header.block_size}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:12]


def calibrations_dir() -> Path:
    """``$VCONSOLE_CALIBRATIONS``, else ``$VCONSOLE_CACHE/calibrations``, else
    ``~/.cache/vconsole/calibrations``."""
    own = os.environ.get("VCONSOLE_CALIBRATIONS")
    if own:
        return Path(own).expanduser()
    base = os.environ.get("VCONSOLE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "vconsole") \
        / "calibrations"


def _stem(header: TraceHeader) -> str:
    model = re.sub(r"[^A-Za-z0-9._]+", "_", Path(header.model or "model").name)[-40:]
    return f"{model}-{fingerprint(header)}"


def stored_trace_path(header: TraceHeader, root: Path, now: float | None = None) -> Path:
    """Where the console keeps a trace it calibrates: ``root/MODEL-FINGERPRINT-STAMP.jsonl``
    (its calibration is `calibration_path` of it)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() if now is None else now))
    return root / f"{_stem(header)}-{stamp}.jsonl"


def stored(header: TraceHeader, root: Path) -> list[Path]:
    """The calibrations in ``root`` of an engine like ``header``'s (`fingerprint`), newest
    first by the stamp in their names."""
    return sorted(root.glob(f"*-{fingerprint(header)}-*{SUFFIX}"),
                  key=lambda p: p.name.rsplit("-", 1)[-1], reverse=True)


def newest(header: TraceHeader, root: Path) -> Path | None:
    """The newest of `stored`; None when there is none."""
    found = stored(header, root)
    return found[0] if found else None


def _seats(config: dict[str, Any], variants: Iterable[dict[str, Any]]) -> list[int]:
    return sorted({int(config["max_num_seqs"])} | {int(v["max_num_seqs"]) for v in variants
                                                   if "max_num_seqs" in v})


def _budgets(config: dict[str, Any], variants: Iterable[dict[str, Any]]) -> list[int]:
    return sorted({int(config["max_num_batched_tokens"])}
                  | {int(v["max_num_batched_tokens"]) for v in variants
                     if "max_num_batched_tokens" in v})


def rows_grid(seats: list[int]) -> list[int]:
    """1, 2, 4, ... up to the largest of ``seats``, and each of ``seats``."""
    top = max(seats)
    out = {1}
    r = 2
    while r < top:
        out.add(r)
        r *= 2
    return sorted(out | set(seats))


def engine_config(config: dict[str, Any], num_kv_blocks: int,
                  variants: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe engine's config (a report's ``config`` view): the trace's, with the most
    seats and the largest token budget any variant needs, and the largest pool."""
    out = dict(config)
    out["max_num_seqs"] = max(_seats(config, variants))
    out["max_num_batched_tokens"] = max(_budgets(config, variants))
    out["num_kv_blocks"] = max([num_kv_blocks] + [int(v["num_kv_blocks"]) for v in variants
                                                  if "num_kv_blocks" in v])
    return out


def grid(config: dict[str, Any], num_kv_blocks: int, block_size: int, max_model_len: int,
         variants: list[dict[str, Any]]) -> list[Probe]:
    """The probes, in the order they run (see the module docstring). ``config``: the trace's
    scheduler keys (``max_num_seqs``, ``max_num_batched_tokens``); the pool is
    ``num_kv_blocks`` blocks of ``block_size`` tokens."""
    pool_tokens = num_kv_blocks * block_size
    probes: list[Probe] = []
    seen: set[Probe] = set()

    def add(p: Probe) -> None:
        if p not in seen and p.prompt_len >= 1:
            seen.add(p)
            probes.append(p)

    for rows in rows_grid(_seats(config, variants)):
        # A row needs its prompt, its decode and a block of slack in the pool.
        room = min(pool_tokens // rows - DECODE_STEPS - block_size,
                   max_model_len - DECODE_STEPS - 1)
        for ctx in CONTEXTS:
            add(Probe(rows, min(ctx, room), DECODE_STEPS))
    budget = max(_budgets(config, variants))
    for chunk in sorted(set(CHUNKS) | set(_budgets(config, variants))):
        add(Probe(1, min(chunk, budget, pool_tokens - 2 * block_size, max_model_len - 2), 1))
    return probes


def level_factor(trace_steps: list[StepRecord], calib_steps: list[StepRecord]) -> float:
    """How much slower the trace's steps ran than the calibration's would have at the same
    shapes: a model fitted on the calibration alone times every busy step of the trace, and
    the factor is the trace's total time over that, relative to the same ratio on the
    calibration's own steps (so its noise counts on both sides). 1.0 when the calibration
    cannot be fitted alone. The calibration may run while the machine is busier or quieter
    than when the trace was taken; scaled by this factor, it gives the *shape* of the cost
    and the trace its level."""
    trace_busy, calib_busy = busy(trace_steps), busy(calib_steps)
    if not trace_busy:
        return 1.0
    try:
        model = fit(calib_busy)
    except TooLittleTraffic:
        return 1.0

    def ratio(steps: list[StepRecord]) -> float:
        fitted = sum(model.step_dur(s) for s in steps)
        return sum(s.dur for s in steps) / max(fitted, 1e-12)

    return ratio(trace_busy) / max(ratio(calib_busy), 1e-12)


def leveled(trace_steps: list[StepRecord], calib_steps: list[StepRecord]) -> list[StepRecord]:
    """The calibration's steps at the trace's level (`level_factor`): durations and periods
    times the factor."""
    return scaled(calib_steps, level_factor(trace_steps, calib_steps))


def scaled(steps: list[StepRecord], k: float) -> list[StepRecord]:
    """``steps`` with durations and periods times ``k``."""
    return [dataclasses.replace(s, dur=s.dur * k, execute=s.execute * k,
                                period=None if s.period is None else s.period * k)
            for s in steps]
