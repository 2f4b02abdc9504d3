"""Replay a request trace through the engine's own `Scheduler` and `KVCacheManager`, with the
model replaced by the fitted step-time model (`vconsole.whatif.cost_model`).

Nothing of the scheduling is re-implemented: the scheduler decides every step exactly as in the
engine (admission, chunked prefill, the token budget, preemption by recompute, the prefix cache
over synthetic prompts that share the recorded prefixes), on a virtual clock. Per step:

1. requests whose arrival time has come are added (in the engine, a request that arrives
   during a step waits for it to end, as here);
2. ``schedule()`` at the step's start; the step lasts the model's ``dur`` for what it
   scheduled, plus a residual drawn from the trace's own steps of that length
   (`StepCostModel.sampler`, seeded: the same run gives the same figures); every row that reached its last token samples a token (a placeholder id: the
   simulated requests ignore EOS and stop at their recorded output length);
3. ``update_from_output`` at ``start + dur`` (its clock stamps first tokens and gaps, as the
   engine's does);
4. the next step starts ``gap`` later when work is left, else at the next arrival.

Finished requests become `RequestRecord`s through `request_record`, the function the engine's
own trace uses, so predicted and observed figures are computed alike (`figures`).

The loop (`run_on_virtual_clock`) takes the step as a function, so other drivers share it:
`bench kv-ideas` steps the real model, or the model replaced by a recorded trace, on the same
clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vconsole.engine.request import Request
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import FIELDS, EngineConfig, validate_config
from vconsole.telemetry.request_trace import (
    RequestRecord,
    StepRecord,
    Trace,
    finished_normally,
    request_record,
    synthetic_prompt,
)
from vconsole.whatif.cost_model import StepCostModel
from vconsole.wire.sampling import SamplingParams

PLACEHOLDER_TOKEN = 1
IDLE_WAIT_S = 0.005     # the engine's wait after a step that scheduled nothing
MAX_IDLE_STEPS = 100_000   # in a row: a config under which nothing can ever run again


@dataclass
class SimResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    num_kv_blocks: int
    block_size: int
    rejected: int                 # could never run under this config (too long for the pool)
    fragmentation_mean: float     # 1 - tokens stored / slots of used blocks, over busy steps
    sim_seconds: float = 0.0      # wall time the simulation took


def engine_config(values: dict[str, Any]) -> EngineConfig:
    """A validated `EngineConfig` from a trace's config dict (keys this version does not
    know are left out: a trace from an older or newer engine)."""
    return validate_config({k: v for k, v in values.items() if k in FIELDS})


@dataclass
class ClockRun:
    """What `run_on_virtual_clock` leaves: the clock at its end, the requests the scheduler
    took (in arrival order) and how many it refused (too long for its pool)."""

    end: float
    admitted: list[Request]
    rejected: int


def run_on_virtual_clock(sched: Scheduler, arrivals: Sequence[float],
                         make: Callable[[int], Request],
                         step: Callable[[float], tuple[float, bool]], clock: list[float], *,
                         before: Callable[[float], None] | None = None) -> ClockRun:
    """Drive ``sched`` through requests that arrive at ``arrivals`` (seconds, ascending) on a
    virtual clock, until every one has finished or was refused.

    Each turn, at time ``t``: ``before(t)`` (changes due by then), ``clock[0] = t`` (the
    scheduler's clock), every request whose arrival has come is made (``make(index)``) and
    added, then ``step(t)`` runs one step and returns when the next may start and whether it
    ran anything; an idle scheduler jumps to the next arrival. The step owns the clock while it
    runs (and so what the scheduler stamps). A run of `MAX_IDLE_STEPS` steps in a row that
    ran nothing is a stall (a config under which nothing can ever run again): RuntimeError."""
    n = len(arrivals)
    t = arrivals[0] if n else 0.0
    admitted: list[Request] = []
    rejected = i = idle_steps = 0
    while i < n or sched.has_requests():
        if before is not None:
            before(t)
        clock[0] = t
        while i < n and arrivals[i] <= t:
            req = make(i)
            i += 1
            try:
                sched.add_request(req)
                admitted.append(req)
            except ValueError:
                rejected += 1
        if not sched.has_requests():
            if i >= n:
                break           # the last arrivals could never run (rejected): done
            t = max(t, arrivals[i])
            continue
        t, ran = step(t)
        idle_steps = 0 if ran else idle_steps + 1
        if idle_steps > MAX_IDLE_STEPS:
            raise RuntimeError(f"the simulation stalled at t={t:.3f} s: {sched.num_waiting} "
                               f"requests wait and none can be scheduled")
    return ClockRun(t, admitted, rejected)


def simulate(trace: Trace, config: EngineConfig, num_kv_blocks: int, model: StepCostModel,
             *, max_model_len: int, vocab_size: int,
             config_changes: list[tuple[float, EngineConfig]] | None = None,
             seed: int = 0) -> SimResult:
    """Run ``trace``'s requests under ``config`` with ``num_kv_blocks`` blocks of
    ``config.block_size``. ``config_changes``: (time, config) applied from that time on, as
    the engine applied hot changes (the baseline replays the trace's own)."""
    wall0 = time.perf_counter()
    clock = [0.0]
    B = config.block_size
    trace_B = trace.header.block_size
    sched = Scheduler(config, num_kv_blocks, B, max_model_len, clock=lambda: clock[0])
    pool = sched.kv.pool
    changes = sorted(config_changes or [], key=lambda c: c[0])
    pending = [r for r in trace.requests if finished_normally(r)]
    pending.sort(key=lambda r: r.arrival)
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    frag_sum, frag_n = 0.0, 0
    version = trace.header.config_version
    draw = model.sampler(seed)

    def apply_changes(t: float) -> None:
        while changes and changes[0][0] <= t:
            sched.update_config(changes.pop(0)[1])

    def make(i: int) -> Request:
        rec = pending[i]
        return Request(request_id=str(i),
                       prompt_token_ids=synthetic_prompt(rec, i, trace_B, vocab_size),
                       sampling=SamplingParams(max_tokens=rec.output_len, ignore_eos=True),
                       priority=rec.priority, arrival_time=rec.arrival)

    def step(t: float) -> tuple[float, bool]:
        nonlocal frag_sum, frag_n
        so = sched.schedule()
        ran = so.total_num_scheduled_tokens
        native = model.runs_native(so.num_prefill_tokens, so.num_decode_tokens)
        dur = draw(model.dur(so.num_prefill_tokens, so.num_decode_tokens,
                             so.num_context_tokens, so.prefill_attention,
                             len(so.scheduled_new_reqs), native=native)) if ran else 0.0
        clock[0] = t + dur
        out = ModelRunnerOutput(sampled=dict.fromkeys(so.num_scheduled_tokens, PLACEHOLDER_TOKEN))
        for req, res in sched.update_from_output(so, out):
            if res.finished:
                records.append(request_record(req, t0=0.0, finish=clock[0],
                                              config_version=version, block_hashes=[]))
        if not ran:
            # Nothing ran (a timeout reported, or every waiting request blocked): the engine
            # waits briefly for input, as its busy loop does.
            return t + IDLE_WAIT_S, False
        used = pool.num_used_blocks
        holding = used - sched.kv.num_staging_blocks     # lent staging blocks hold no token
        if holding > 0:
            frag_sum += 1.0 - pool.tokens_stored / (holding * B)
            frag_n += 1
        more = sched.has_requests()
        gap = model.gap(so.num_scheduled_reqs)
        steps.append(StepRecord(
            t=t, dur=dur, execute=dur, prefill=so.num_prefill_tokens,
            decode=so.num_decode_tokens, reqs=so.num_scheduled_reqs,
            running=sched.num_running, waiting=sched.num_waiting,
            context=so.num_context_tokens, prefill_attn=so.prefill_attention,
            new_reqs=len(so.scheduled_new_reqs), preempted=len(so.preempted_req_ids),
            kv_used=used, period=dur + gap if more else None, native=native))
        return t + dur + gap, True

    run = run_on_virtual_clock(sched, [r.arrival for r in pending], make, step, clock,
                               before=apply_changes)
    return SimResult(records, steps, num_kv_blocks, B, run.rejected,
                     frag_sum / frag_n if frag_n else 0.0, time.perf_counter() - wall0)


def config_replace(config: EngineConfig, values: dict[str, Any]) -> EngineConfig:
    return dataclasses.replace(config, **values)
