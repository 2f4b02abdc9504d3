"""`vconsole load --trace FILE`: a recorded request trace replayed against a live engine.

A trace (`vconsole.telemetry.request_trace`: the engine's JSON lines, or a public CSV) becomes a
fixed schedule of requests (`vconsole.tools.loadgen.TimedRequest`) that `run_timed` sends over
the engine's socket or over HTTP alike:

- arrivals on the trace's timestamps, relative to the first request replayed, divided by
  ``speed`` (2.0: twice as fast);
- the same prompt lengths and shared prefixes: `synthetic_prompt` with the *trace's* block size
  (the size its hashes were computed at) and the engine's vocabulary, so prompts whose recorded
  block hashes were equal share exactly those blocks' tokens (whatever block size the engine
  serves with: that is a what-if of its own);
- exact output lengths (``max_tokens = output_len``, ``ignore_eos``, greedy) and the recorded
  priorities.

What is not replayed, counted by reason in ``skipped`` and never sent:

- ``not_finished``: a request that did not finish normally in the trace (aborted, an error, a
  timeout; `finished_normally` false). Its recorded ``output_len`` is where something cut it
  short, not what it would have generated, and replaying its ``max_tokens`` would invent load
  the engine never had: it is skipped, as `vconsole whatif` skips it, so a replay and a
  prediction describe the same requests.
- ``too_long``: ``prompt_len + output_len`` beyond the engine's ``max_model_len`` (a trace from
  an engine with a longer context); the engine would refuse it.
- ``never_fits``: more KV blocks than the engine's whole pool (its hello's ``num_kv_blocks``
  and ``block_size``; a smaller pool than the trace's): the engine would refuse it, and
  `vconsole whatif` counts it as ``rejected``.

Refused before anything is sent (`TraceError`, exit 2): a trace recorded on another model than
the engine serves (`check_model`; the engine's model is its hello's ``model``, over HTTP the
served model's id), and a trace with nothing left to replay. Over HTTP the vocabulary is the
one ``/v1/models`` lists (`vconsole serve` lists it; where a server does not, the HTTP client's
`DEFAULT_VOCAB`, 1,000: ids below it are valid tokens of any real model, and prefixes are shared
alike whatever the vocabulary).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vconsole.telemetry.request_trace import (
    Trace,
    TraceError,
    check_model,
    finished_normally,
    synthetic_prompt,
)
from vconsole.tools.load_summary import LoadRun
from vconsole.tools.loadgen import TimedRequest

SKIP_REASONS = {
    "not_finished": "did not finish normally in the trace (aborted, error, timeout)",
    "too_long": "prompt_len + output_len beyond the engine's max_model_len",
    "never_fits": "needs more KV blocks than the engine's whole pool",
}


def check_speed(speed: float) -> float:
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"--speed must be a number > 0, got {speed:g}")
    return speed


@dataclass
class ReplayPlan:
    """The requests a trace replays against one engine, and what it leaves out."""

    file: str
    trace: Trace
    speed: float
    vocab_size: int
    requests: list[TimedRequest] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)    # SKIP_REASONS -> count

    @property
    def span_s(self) -> float:
        """From the first send to the last one, on the replay's clock."""
        return self.requests[-1].at if self.requests else 0.0

    def report(self, run: LoadRun) -> dict[str, Any]:
        """The ``trace`` object of the load's summary: ``replayed`` is how many were sent
        (fewer than ``planned`` after a Ctrl-C or a lost engine)."""
        h = self.trace.header
        return {"file": self.file, "source": h.source, "model": h.model,
                "block_size": h.block_size, "requests": len(self.trace.requests),
                "planned": len(self.requests), "replayed": run.sent,
                "skipped": sum(self.skipped.values()), "skipped_by_reason": dict(self.skipped),
                "speed": self.speed, "arrival_span_s": round(self.span_s, 6),
                "late_s": round(run.late_s, 6), "vocab_size": self.vocab_size}


def plan_replay(trace: Trace, engine_info: dict[str, Any], *, speed: float = 1.0,
                file: str | os.PathLike[str] = "trace") -> ReplayPlan:
    """The schedule that replays ``trace`` against the engine ``engine_info`` describes (its
    hello: ``model``, ``vocab_size``, ``max_model_len``). Raises `TraceError` with the reason
    when the trace cannot be replayed there."""
    check_speed(speed)
    why = check_model(trace, engine_info.get("model"))
    if why is not None:
        raise TraceError(why)
    vocab = int(engine_info["vocab_size"])
    max_len = int(engine_info.get("max_model_len") or 0) or None
    # The engine's pool, where it says (its hello does; an HTTP server may not): a request
    # that needs more blocks than all of them would be refused, as the simulator rejects it.
    pool_blocks = int(engine_info.get("num_kv_blocks") or 0)
    engine_block = int(engine_info.get("block_size") or 0)
    plan = ReplayPlan(str(file), trace, speed, vocab)
    skipped: Counter[str] = Counter()
    kept = []
    for rec in trace.requests:
        if not finished_normally(rec):
            skipped["not_finished"] += 1
        elif max_len is not None and rec.prompt_len + rec.output_len > max_len:
            skipped["too_long"] += 1
        elif pool_blocks and engine_block and \
                -(-(rec.prompt_len + rec.output_len - 1) // engine_block) > pool_blocks:
            skipped["never_fits"] += 1
        else:
            kept.append(rec)
    plan.skipped = {k: skipped[k] for k in SKIP_REASONS if skipped[k]}
    if not kept:
        reasons = ", ".join(f"{n} {SKIP_REASONS[k]}" for k, n in plan.skipped.items())
        raise TraceError(f"{file}: nothing to replay: all {len(trace.requests)} requests are "
                         f"left out ({reasons})")
    t0 = min(r.arrival for r in kept)
    block_size = trace.header.block_size
    for i, rec in enumerate(sorted(kept, key=lambda r: r.arrival)):
        plan.requests.append(TimedRequest(
            at=(rec.arrival - t0) / speed,
            prompt_token_ids=synthetic_prompt(rec, i, block_size, vocab),
            max_tokens=rec.output_len, priority=rec.priority))
    return plan


def format_report(t: dict[str, Any]) -> str:
    """The ``trace`` object as a line under `format_summary`'s."""
    skipped = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in t["skipped_by_reason"].items())
    line = (f"trace        {t['file']}: {t['replayed']} of {t['requests']} requests replayed "
            f"at {t['speed']:g}x over {t['arrival_span_s']:.2f} s of arrivals")
    if skipped:
        line += f" (skipped: {skipped})"
    if t["late_s"] > 0.05:
        line += f"; sends up to {t['late_s'] * 1000:.0f} ms late"
    return line
