"""`bench kv-ideas`'s workload: the demo's requests (chat prompts, priorities, output limits)
at the demo's varying Poisson rate on a virtual clock, the demo's engine and pool, the clock's
step cost, and a finished request as the real engine ran it (`Traced`, what a replay needs)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from vconsole.tools.demo import REAL_ENGINE_DEFAULTS, REAL_RATE
from vconsole.tools.loadgen import Workload, demo_rate, demo_spec

MODEL = "smollm2"
# The demo's engine and rate on the real model (its pool, a byte budget there, as 64 float32
# blocks of 16 tokens), with the block size made explicit.
DEMO_BLOCKS, DEMO_BLOCK_SIZE = 64, 16
DEMO_ENGINE = {k: v for k, v in REAL_ENGINE_DEFAULTS.items() if k != "kv_cache_memory_bytes"}
DEMO_RATE = REAL_RATE
# The virtual clock: seconds per step, about smollm2's float32 pace on 2 cores (the 40-request
# run: 506 steps, 51 s virtual against 56 s inside steps at load 3.4-5 with one torch thread).
STEP_BASE_S = 0.08
STEP_PER_TOKEN_S = 0.002


@dataclass
class Arrival:
    """A request of the workload: its prompt, output limit, priority and virtual arrival time."""

    prompt: list[int]
    max_tokens: int
    priority: int
    at_s: float


@dataclass
class Traced:
    """A finished request as the real engine ran it: what a replay needs."""

    rid: str
    prompt: list[int]
    output: list[int]
    priority: int
    at_s: float
    num_preemptions: int = 0


def demo_arrivals(tokenizer: Any, num: int, seed: int = 0, vocab_size: int = 49152,
                  max_model_len: int = 8192, rate: float = DEMO_RATE) -> list[Arrival]:
    """The demo's requests (`demo_spec` with chat prompts) at the demo's varying Poisson rate,
    on a virtual clock: the same list for the same seed."""
    from vconsole.tools.prompts import ChatRenderer

    workload = Workload(demo_spec(seed, "chat"), vocab_size, max_model_len,
                        chat=ChatRenderer(tokenizer))
    rng, rate_fn, t = random.Random(seed + 1), demo_rate(rate), 0.0
    out = []
    for _ in range(num):
        t += rng.expovariate(rate_fn(t))
        ids, max_tokens, priority = workload.next()
        out.append(Arrival(ids, max_tokens, priority, t))
    return out

