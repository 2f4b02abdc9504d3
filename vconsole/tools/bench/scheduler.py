"""`vconsole bench scheduler`: the scheduler's own cost per step, with model execution stubbed.

The real `Scheduler` (and so the real `KVCacheManager` and `WaitingQueue`) runs 256 decoding
requests while N wait; the "model" samples one token for every request whose chunk reaches its
last token, which is all `update_from_output` needs. Per step we time `schedule()` and
`update_from_output()` separately and report the median over the measured steps. The sizes of
one policy are stepped round robin, so load from elsewhere on the machine falls on all alike.

Steady state: running requests ask for 16–256 output tokens, so a couple finish every step and
free a seat; each finished request is replaced by a new one at the back of the waiting queue, so
N stays constant and every step also admits (and prefills) a request or two. Priorities are drawn
from four classes. The peer is the same scheduler at 100 waiting: the goal is that a deep queue
costs (almost) nothing, ``t(50k) / t(100) <= 2``, and one step stays under 1 ms at 50k.
``us_per_running_request`` (the step at the largest N over the 256 running) stands beside
``vllm_us_per_running_request``, vLLM's published figure (a constant, not run here).

``queue_impl`` compares the waiting queue alone, our heap against the seed's time wheel
(`vconsole.tools.bench.waiting_queue`), per admission at each size.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

from vconsole.engine.request import Request
from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import EngineConfig
from vconsole.tools.bench.waiting_queue import queue_bench
from vconsole.wire.sampling import SamplingParams

POLICIES = ("fcfs", "priority", "hybrid")
DEFAULT_SIZES = (100, 1_000, 10_000, 50_000)
NUM_RUNNING = 256
BLOCK_SIZE = 16
PROMPT_LEN = 64
MAX_TOKENS = (16, 256)
PRIORITY_CLASSES = (0, 1, 2, 5)
GOAL_STEP_US = 1000.0
GOAL_RATIO = 2.0
# vLLM's figure for comparison, not measured here: its v1 scheduler's cost per running request
# on a CPU (schedule + update_from_output, ~3.2 ms per step at 256 running), as issue #21 cites.
VLLM_US_PER_RUNNING_REQUEST = 12.7


class _Workload:
    """Makes requests with a fixed seed; prompts are distinct so the prefix cache never hits."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.n = 0

    def request(self) -> Request:
        self.n += 1
        base = self.n * PROMPT_LEN
        return Request(f"r{self.n}", list(range(base, base + PROMPT_LEN)),
                       SamplingParams(max_tokens=self.rng.randint(*MAX_TOKENS), ignore_eos=True),
                       priority=self.rng.choice(PRIORITY_CLASSES))


def _sample(sched: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    """The stub model: one token for each request whose chunk ends at its last token."""
    sampled: dict[str, int] = {}
    for rid, start in so.start_positions().items():
        req = sched.get_request(rid)
        if req is not None and start + so.num_scheduled_tokens[rid] == req.num_tokens:
            sampled[rid] = 7
    return ModelRunnerOutput(sampled)


def make_scheduler(policy: str) -> Scheduler:
    max_len = PROMPT_LEN + MAX_TOKENS[1]
    blocks_per_req = -(-max_len // BLOCK_SIZE)
    cfg = EngineConfig(policy=policy, max_num_seqs=NUM_RUNNING,
                       max_num_batched_tokens=NUM_RUNNING + 8 * PROMPT_LEN)
    # Room for every running request at full length, plus slack: never a preemption.
    return Scheduler(cfg, NUM_RUNNING * blocks_per_req * 5 // 4, BLOCK_SIZE, max_len)


class _Bench:
    """One scheduler at ``num_waiting`` waiting (plus 256 running), stepped one step at a time."""

    def __init__(self, policy: str, num_waiting: int, seed: int = 0) -> None:
        self.policy, self.num_waiting = policy, num_waiting
        self.sched = make_scheduler(policy)
        self.wl = _Workload(seed)
        for _ in range(NUM_RUNNING + num_waiting):
            self.sched.add_request(self.wl.request())
        self.schedule_ns: list[int] = []
        self.update_ns: list[int] = []
        self.finished = 0
        self.min_running = NUM_RUNNING
        warm = 0
        while self.sched.num_running < NUM_RUNNING or warm < 20:
            self.step(record=False)
            warm += 1
            if warm > 10_000:
                raise RuntimeError("the scheduler never reached 256 running")

    def step(self, record: bool = True) -> None:
        sched = self.sched
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        out = _sample(sched, so)
        t2 = time.perf_counter_ns()
        results = sched.update_from_output(so, out)
        t3 = time.perf_counter_ns()
        done = sum(1 for _, o in results if o.finished)
        for _ in range(done):     # keep N waiting: a new request for every finished one
            sched.add_request(self.wl.request())
        if record:
            self.schedule_ns.append(t1 - t0)
            self.update_ns.append(t3 - t2)
            self.finished += done
            self.min_running = min(self.min_running, sched.num_running)

    def result(self) -> dict[str, Any]:
        sched, steps = self.sched, len(self.schedule_ns)
        assert sched.num_waiting + sched.num_running == self.num_waiting + NUM_RUNNING
        return {"policy": self.policy, "num_waiting": self.num_waiting,
                "num_running": NUM_RUNNING,
                "schedule_us": round(statistics.median(self.schedule_ns) / 1000, 1),
                "update_us": round(statistics.median(self.update_ns) / 1000, 1),
                "steps": steps, "finished_per_step": round(self.finished / steps, 2),
                "min_running": self.min_running, "preemptions": sched.num_preemptions_total}


def run_policy(policy: str, sizes: list[int], steps: int) -> list[dict[str, Any]]:
    """Every size of one policy, stepped in turn (one step each, round robin), so that load
    from elsewhere on the machine falls on all sizes alike and the ratios stay fair."""
    benches = [_Bench(policy, n) for n in sizes]
    gc.collect()
    for _ in range(steps):
        for b in benches:
            b.step()
    return [b.result() for b in benches]


def goal(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: step time at the largest N, and its ratio to the smallest N."""
    per_policy: dict[str, Any] = {}
    for policy in POLICIES:
        rows = sorted((r for r in results if r["policy"] == policy),
                      key=lambda r: r["num_waiting"])
        if not rows:
            continue
        lo, hi = rows[0], rows[-1]
        t_lo = lo["schedule_us"] + lo["update_us"]
        t_hi = hi["schedule_us"] + hi["update_us"]
        ratio = round(t_hi / t_lo, 2) if t_lo else None
        per_policy[policy] = {
            "step_us_at_max": round(t_hi, 1), "max_waiting": hi["num_waiting"],
            "us_per_running_request": round(t_hi / hi["num_running"], 2),
            "ratio": ratio, "ratio_of": f"t({hi['num_waiting']})/t({lo['num_waiting']})",
            "step_met": t_hi < GOAL_STEP_US,
            "ratio_met": ratio is not None and ratio <= GOAL_RATIO,
        }
    return {"step_us_max": GOAL_STEP_US, "ratio_max": GOAL_RATIO,
            "vllm_us_per_running_request": VLLM_US_PER_RUNNING_REQUEST, "policies": per_policy,
            "met": bool(per_policy) and all(p["step_met"] and p["ratio_met"]
                                             for p in per_policy.values())}


def scheduler_bench(sizes: list[int] | None = None, steps: int = 300,
                    log: Any = None) -> dict[str, Any]:
    sizes = sorted(sizes or DEFAULT_SIZES)
    results = []
    for policy in POLICIES:
        if log:
            log(f"{policy}: {', '.join(map(str, sizes))} waiting ...")
        results += run_policy(policy, sizes, steps)
    if log:
        log("waiting queue: heap vs the seed's time wheel ...")
    return {"benchmark": "scheduler", "num_running": NUM_RUNNING, "block_size": BLOCK_SIZE,
            "prompt_len": PROMPT_LEN, "max_tokens": list(MAX_TOKENS), "steps": steps,
            "results": results, "goal": goal(results),
            "queue_impl": queue_bench(sizes, rounds=max(200, 4 * steps))}
