"""Replay a request trace through the engine's own `Scheduler` and `KVCacheManager`, with the
model replaced by the fitted step-time model (`vconsole.whatif.cost_model`).

Nothing of the scheduling is re-implemented: the scheduler decides every step exactly as in the
engine (admission, chunked prefill, the token budget, preemption by recompute, the prefix cache
over synthetic prompts that share the recorded prefixes), on a virtual clock. Per step:

1. requests whose arrival time has come are added (in the engine, a request that arrives
   during a step waits for it to end, as here);
2. ``schedule()`` at the step's start; the step lasts the model's ``dur`` for what it
   scheduled, times a factor drawn from the trace's own spread (`StepCostModel.noise`, seeded:
   the same run gives the same figures); every row that reached its last token samples a token (a placeholder id: the
   simulated requests ignore EOS and stop at their recorded output length);
3. ``update_from_output`` at ``start + dur`` (its clock stamps first tokens and gaps, as the
   engine's does);
4. the next step starts ``gap`` later when work is left, else at the next arrival.

Finished requests become `RequestRecord`s through `request_record`, the function the engine's
own trace uses, so predicted and observed figures are computed alike (`figures`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from vconsole.engine.request import Request, SamplingParams
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
    rejected = 0
    frag_sum, frag_n = 0.0, 0
    i = 0
    t = pending[0].arrival if pending else 0.0
    version = trace.header.config_version
    noise = model.noise(seed)
    idle_steps = 0

    def finish(req: Request) -> None:
        records.append(request_record(req, t0=0.0, finish=clock[0], config_version=version,
                                      block_hashes=[]))

    while i < len(pending) or sched.has_requests():
        while changes and changes[0][0] <= t:
            sched.update_config(changes.pop(0)[1])
        clock[0] = t
        while i < len(pending) and pending[i].arrival <= t:
            rec = pending[i]
            req = Request(request_id=str(i),
                          prompt_token_ids=synthetic_prompt(rec, i, trace_B, vocab_size),
                          sampling=SamplingParams(max_tokens=rec.output_len, ignore_eos=True),
                          priority=rec.priority, arrival_time=rec.arrival)
            i += 1
            try:
                sched.add_request(req)
            except ValueError:
                rejected += 1
        if not sched.has_requests():
            if i >= len(pending):
                break           # the last arrivals could never run (rejected): done
            t = max(t, pending[i].arrival)
            continue
        so = sched.schedule()
        ran = so.total_num_scheduled_tokens
        dur = model.dur(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens,
                        so.prefill_attention, len(so.scheduled_new_reqs)) * next(noise) \
            if ran else 0.0
        clock[0] = t + dur
        out = ModelRunnerOutput(sampled=dict.fromkeys(so.num_scheduled_tokens, PLACEHOLDER_TOKEN))
        for req, res in sched.update_from_output(so, out):
            if res.finished:
                finish(req)
        if ran:
            used = pool.num_used_blocks
            if used:
                frag_sum += 1.0 - pool.tokens_stored / (used * B)
                frag_n += 1
            more = sched.has_requests()
            gap = model.gap(so.num_scheduled_reqs)
            steps.append(StepRecord(
                t=t, dur=dur, execute=dur, prefill=so.num_prefill_tokens,
                decode=so.num_decode_tokens, reqs=so.num_scheduled_reqs,
                running=sched.num_running, waiting=sched.num_waiting,
                context=so.num_context_tokens, prefill_attn=so.prefill_attention,
                new_reqs=len(so.scheduled_new_reqs), preempted=len(so.preempted_req_ids),
                kv_used=used, period=dur + gap if more else None))
            t = t + dur + gap
            idle_steps = 0
        else:
            # Nothing ran (a timeout reported, or every waiting request blocked): the engine
            # waits briefly for input, as its busy loop does.
            t = t + IDLE_WAIT_S
            idle_steps += 1
            if idle_steps > MAX_IDLE_STEPS:
                raise RuntimeError(f"the simulation stalled at t={t:.3f} s: {sched.num_waiting} "
                                   f"requests wait and none can be scheduled")
    return SimResult(records, steps, num_kv_blocks, B, rejected,
                     frag_sum / frag_n if frag_n else 0.0, time.perf_counter() - wall0)


def config_replace(config: EngineConfig, values: dict[str, Any]) -> EngineConfig:
    return dataclasses.replace(config, **values)
