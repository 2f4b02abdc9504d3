"""`bench kv-ideas`'s runs: the workload through a scheduler on the virtual clock — the real
in-process engine (`run_engine`), or the real `Scheduler` and KV manager with the model
replaced by a recorded trace (`replay`) — driven by the what-if's loop
(`vconsole.whatif.simulate.run_on_virtual_clock`), each step costing `STEP_BASE_S` +
`STEP_PER_TOKEN_S` x its tokens; with the pool's waste, preemptions and prefix hits per run."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.request import Request
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import EngineConfig
from vconsole.tools.bench.kv_ideas_workload import (
    DEMO_ENGINE,
    MODEL,
    STEP_BASE_S,
    STEP_PER_TOKEN_S,
    Arrival,
    Traced,
)
from vconsole.whatif.simulate import run_on_virtual_clock
from vconsole.wire.sampling import SamplingParams


@dataclass
class RunStats:
    """One run over a workload: steps, preemptions, the pool's waste averaged over steps."""

    steps: int = 0
    preemptions: int = 0
    output_tokens: int = 0
    engine_s: float = 0.0          # wall time inside steps
    virtual_s: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    wasted_slots_sum: float = 0.0  # per step: used blocks x B - tokens stored
    used_slots_sum: float = 0.0
    pool_slots: int = 0
    rejected: int = 0
    traced: list[Traced] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "steps": self.steps, "preemptions": self.preemptions,
            "output_tokens": self.output_tokens, "rejected": self.rejected,
            "engine_s": round(self.engine_s, 2), "virtual_s": round(self.virtual_s, 1),
            "output_tok_s": round(self.output_tokens / self.engine_s, 1)
            if self.engine_s > 0 else None,
            "prefix_hit_rate": round(self.prefix_hits / self.prefix_queries, 4)
            if self.prefix_queries else 0.0,
            # internal fragmentation: slots allocated but empty (the partial last blocks), as a
            # share of allocated slots and of the pool, averaged over steps
            "fragmentation": round(self.wasted_slots_sum / self.used_slots_sum, 4)
            if self.used_slots_sum else 0.0,
            "wasted_slots_mean": round(self.wasted_slots_sum / n, 1),
            "wasted_share_of_pool": round(self.wasted_slots_sum / n / self.pool_slots, 4)
            if self.pool_slots else 0.0,
        }


def _drive(scheduler: Scheduler, arrivals: Sequence[Arrival],
           make: Callable[[int, Arrival], Request], step: Callable[[], int],
           clock: list[float]) -> RunStats:
    """The arrivals through ``scheduler`` on the what-if's virtual clock: ``make(i, arrival)``
    builds request i, ``step()`` runs one engine step and returns the tokens it computed (the
    clock advances by their cost); per step, the pool's used and wasted slots."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    stats = RunStats(pool_slots=kv.num_blocks * kv.block_size)
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    made: dict[str, Arrival] = {}

    def make_one(i: int) -> Request:
        req = make(i, arrivals[i])
        made[req.request_id] = arrivals[i]
        return req

    def timed_step(t: float) -> tuple[float, bool]:
        t0 = time.perf_counter()
        tokens = step()
        stats.engine_s += time.perf_counter() - t0
        stats.steps += 1
        used = pool.num_used_blocks
        stats.used_slots_sum += used * kv.block_size
        stats.wasted_slots_sum += used * kv.block_size - pool.tokens_stored
        return t + (STEP_BASE_S + STEP_PER_TOKEN_S * tokens), tokens > 0

    run = run_on_virtual_clock(scheduler, [a.at_s for a in arrivals], make_one, timed_step,
                               clock)
    stats.virtual_s, stats.rejected = run.end, run.rejected
    stats.preemptions = scheduler.num_preemptions_total
    stats.prefix_queries, stats.prefix_hits = kv.prefix_queries - q0, kv.prefix_hits - h0
    for req in run.admitted:
        a = made[req.request_id]
        stats.output_tokens += len(req.output_token_ids)
        stats.traced.append(Traced(req.request_id, list(req.prompt_token_ids),
                                   list(req.output_token_ids), a.priority, a.at_s,
                                   req.num_preemptions))
    return stats


def run_engine(arrivals: Sequence[Arrival], *, model: str = MODEL, **config: Any) -> tuple[
        RunStats, dict[str, Any], Any]:
    """The arrivals through a real in-process `EngineCore` (greedy, stopping at the model's end
    of turn or ``max_tokens``). Returns the run, the engine's pool figures and the core."""
    from vconsole.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=model, **config))
    clock = [0.0]
    core.scheduler.clock = lambda: clock[0]

    def make(i: int, a: Arrival) -> Request:
        req = core.make_request(f"r{i}", prompt_token_ids=a.prompt, priority=a.priority,
                                sampling=SamplingParams(max_tokens=a.max_tokens))
        req.arrival_time = a.at_s       # the hybrid policy ages requests on this clock
        return req

    def step() -> int:
        core.step()
        last = core.last_step
        return last.num_prefill_tokens + last.num_decode_tokens if last else 0

    stats = _drive(core.scheduler, arrivals, make, step, clock)
    info = {"num_blocks": core.num_kv_blocks, "block_size": core.config.block_size,
            "kv_cache_dtype": core.runner.kv_cache_dtype,
            "kv_bytes_per_token": core.runner.kv_bytes_per_token,
            "pool_tokens": core.num_kv_blocks * core.config.block_size,
            "forward": core.runner.forward_path}
    return stats, info, core


def replay(trace: Sequence[Traced], block_size: int, num_blocks: int, *,
           max_model_len: int = 8192, **config: Any) -> RunStats:
    """The trace through the real `Scheduler` and KV manager with the model replaced by the
    trace itself: a request's sampling step returns the token the real model produced at that
    point, and it stops after as many tokens as it produced (deterministic; no torch)."""
    clock = [0.0]
    sched = Scheduler(EngineConfig(**{**DEMO_ENGINE, **config}), num_blocks, block_size,
                      max_model_len, clock=lambda: clock[0])
    outputs = {t.rid: t.output for t in trace}
    arrivals = [Arrival(t.prompt, len(t.output), t.priority, t.at_s) for t in trace]
    by_rid: dict[str, Request] = {}

    def make(i: int, a: Arrival) -> Request:
        rid = trace[i].rid
        req = Request(rid, list(a.prompt), SamplingParams(max_tokens=a.max_tokens,
                                                          ignore_eos=True),
                      priority=a.priority, arrival_time=a.at_s)
        by_rid[rid] = req
        return req

    def step() -> int:
        so = sched.schedule()
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = by_rid[rid]
            if req.num_computed_tokens + n == req.num_tokens:
                sampled[rid] = outputs[rid][len(req.output_token_ids)]
        sched.update_from_output(so, ModelRunnerOutput(sampled=sampled))
        return so.total_num_scheduled_tokens

    return _drive(sched, arrivals, make, step, clock)


def load_text() -> str:
    """The machine's 1-, 5- and 15-minute load averages, as text beside each run."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"

