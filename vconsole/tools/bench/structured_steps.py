"""`bench structured`'s reading of the engine's request trace: its step lines, a run's steps
(those inside the run's wall-clock window) and their figures, the steady decode steps' median
among them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

STEP_KEYS = {"kind", "t", "dur", "execute", "prefill", "decode", "reqs", "running", "waiting",
             "context", "prefill_attn", "new_reqs", "preempted", "finished", "kv_used",
             "period"}


def read_steps(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """The trace's ``started_unix`` and its step lines as dicts (every key kept, the engine's
    own additions too: a structured-output phase, if it records one)."""
    started, steps = 0.0, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            obj = json.loads(line)
            if obj.get("kind") == "header":
                started = float(obj.get("started_unix", 0.0))
            elif obj.get("kind") == "step":
                steps.append(obj)
    return started, steps


def step_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's steps: how many, their median, and the decode-only steps at the run's steady
    batch (at least 3/4 of its widest decode), whose median is the cost of one step of
    ``decode`` rows; with the structured phase's share of the step when the engine records
    one (any numeric key the trace adds beside the known ones)."""
    if not steps:
        return {"steps": 0}
    widest = max(s["decode"] for s in steps)
    steady = [s for s in steps if s["prefill"] == 0 and s["decode"] >= 0.75 * widest]
    out: dict[str, Any] = {
        "steps": len(steps), "busy_s": round(sum(s["dur"] for s in steps), 3),
        "step_ms_median": round(statistics.median(s["dur"] for s in steps)
                                                      * 1e3, 3),
        "steady_steps": len(steady), "steady_rows_median": statistics.median(
            s["decode"] for s in steady) if steady else None,
        "steady_step_ms_median": round(statistics.median(s["dur"] for s in steady) * 1e3, 3)
        if steady else None}
    extra = sorted({k for s in steps for k, v in s.items() if k not in STEP_KEYS
                    and isinstance(v, int | float) and not isinstance(v, bool)})
    total = sum(s["dur"] for s in steps)
    for k in extra:
        share = sum(float(s.get(k) or 0) for s in steps) / total if total else None
        out[f"{k}_share_of_step"] = round(share, 4) if share is not None else None
    return out


def in_window(steps: list[dict[str, Any]], started: float, t0: float,
              t1: float) -> list[dict[str, Any]]:
    """The steps that started between the wall-clock times ``t0`` and ``t1`` (the trace's
    ``t`` counts from ``started``)."""
    lo, hi = t0 - started, t1 - started
    return [s for s in steps if lo <= s["t"] <= hi]

