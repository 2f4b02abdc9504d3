"""`vconsole bench kv-ideas`: the background write-up's memory ideas, answered with data.

Three measurements on the demo's workload (`vconsole.tools.demo`: ``smollm2``, 64 blocks of 16
tokens, 12 seats, 128 tokens a step, the hybrid policy, the chat prompts of
`vconsole.tools.prompts` arriving at the demo's varying rate), all in this process:

1. **Near-duplicate blocks** ("delta-encode similar prefixes"). Every full block of every request
   (prompt and output) is classified by `block_census`: *hash-equal* to an earlier one (the
   prefix cache shares it already), *same tokens under another prefix* (prefix caching cannot
   share it: its hash covers the prefix), *near* (at least ``near_share`` of its positions equal
   to an earlier distinct block's) or *shifted* (its tokens occur elsewhere at another offset).
   For sampled pairs of such blocks, `kv_deltas` recomputes both blocks' K and V with the model
   and measures what a delta against the reference would cost: the bits per value a delta
   needs to keep int8's step of the original (8 + log2(max|delta| / max|x|) per token and
   head), after RoPE as the pool stores K and before it (the best a delta encoder could do).
   Run on the demo's mix and on a serve-like mix (the same prompts through the chat template,
   half of them followed by a second turn that carries the first turn's answer, as a chat
   client sends it to `vconsole serve`).
2. **Block sizes** ("grow block sizes from 64 tokens by 1.5x"). The real run's trace (each
   request's prompt, its output tokens, priority and arrival) is replayed through the real
   `Scheduler` and KV manager at block sizes 8..128 with the same pool memory in tokens; the
   model is replaced by the trace (`replay`: a sampling step returns the token the real model
   produced there), since fragmentation, preemptions and prefix hits depend only on lengths,
   token ids and the order of arrivals, not on numerics. Replayed at the demo's block size it
   reproduces the real run's preemptions (``replay_matches_real``).
3. **KV dtypes at equal memory**: the demo's workload on the real engine with
   ``kv_cache_memory_bytes`` = the demo's float32 pool (64 x 16 tokens) for ``auto``, ``int8``
   and ``int4``: blocks, preemptions, output tokens per second of engine time.

Arrivals are on a virtual clock, so every run sees the same arrival sequence whatever the
machine's load: request i arrives at the demo's Poisson time t_i (`demo_rate`, seeded), and each
engine step advances the clock by `STEP_BASE_S` + `STEP_PER_TOKEN_S` x its tokens (fitted to
``smollm2`` on 2 cores); an idle engine jumps to the next arrival, and the hybrid policy ages
requests on the same clock (their ``arrival_time``). Throughput is measured on the wall clock over
the steps alone. The loop is the what-if simulator's (`vconsole.whatif.simulate.run_on_virtual_clock`),
given the real model's step or the trace's.

One module per part: the workload (`kv_ideas_workload`), the runs on the virtual clock
(`kv_ideas_runs`), then one per experiment (`kv_ideas_near` with `kv_ideas_census` and
`kv_ideas_deltas`, `kv_ideas_blocks`, `kv_ideas_dtypes`); this one puts them together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from vconsole.tools.bench.kv_ideas_blocks import block_sizes_section
from vconsole.tools.bench.kv_ideas_dtypes import dtype_runs, dtypes_section
from vconsole.tools.bench.kv_ideas_near import near_section
from vconsole.tools.bench.kv_ideas_runs import load_text
from vconsole.tools.bench.kv_ideas_workload import (
    DEMO_BLOCK_SIZE,
    DEMO_BLOCKS,
    DEMO_ENGINE,
    DEMO_RATE,
    MODEL,
    STEP_BASE_S,
    STEP_PER_TOKEN_S,
    demo_arrivals,
)

Log = Callable[[str], None] | None

BLOCK_SIZES = (8, 16, 32, 64, 96, 128)
KV_DTYPES = ("auto", "int8", "int4")


def kv_ideas_bench(log: Log = None, *, num_requests: int | None = None, seed: int = 0,
                   model: str = MODEL, block_sizes: Sequence[int] = BLOCK_SIZES,
                   kv_dtypes: Sequence[str] = KV_DTYPES, serve_requests: int | None = None,
                   pairs: int = 16, parts: Sequence[str] = ("dtypes", "blocks", "near")
                   ) -> dict[str, Any]:
    """All three measurements (``parts`` picks), as one JSON-able dict."""
    t_start = time.perf_counter()

    def say(message: str) -> None:
        if log is not None:
            log(f"[{time.perf_counter() - t_start:6.1f} s] {message}")

    num = num_requests or 40
    out: dict[str, Any] = {
        "model": model, "num_requests": num, "seed": seed,
        "workload": f"the demo's: demo_spec(chat prompts), demo_rate({DEMO_RATE}) Poisson "
                    f"arrivals on a virtual clock ({STEP_BASE_S} s + {STEP_PER_TOKEN_S} s "
                    "per token a step), greedy, stop at end of turn",
        "engine": {**DEMO_ENGINE, "num_kv_blocks": DEMO_BLOCKS, "block_size": DEMO_BLOCK_SIZE},
        "load_before": load_text()}
    from transformers import AutoTokenizer

    from vconsole.engine.worker.model_loader import resolve_model_path

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), local_files_only=True)
    arrivals = demo_arrivals(tokenizer, num, seed, len(tokenizer))
    say(f"{num} requests, {sum(len(a.prompt) for a in arrivals)} prompt tokens, last arrival "
        f"at {arrivals[-1].at_s:.0f} s (virtual)")

    # 3 first: its auto run is the trace the others replay and census.
    if not {"dtypes", "blocks", "near"} & set(parts):
        runs = None
    else:
        runs = dtype_runs(arrivals, model, kv_dtypes if "dtypes" in parts else ("auto",), say)
        if "dtypes" in parts:
            out["dtypes"] = dtypes_section(runs)
    if runs is not None and "blocks" in parts and runs.trace:
        real = out.get("dtypes", {}).get("runs", {}).get("auto", {})
        out["block_sizes"] = block_sizes_section(runs.trace, block_sizes, real, say)
    if runs is not None and "near" in parts and runs.auto_core is not None:
        out["near_duplicates"] = near_section(
            runs.auto_core, runs.trace, runs.bytes_per_token,
            serve_requests=serve_requests or num, pairs=pairs, seed=seed, say=say)
    out["load_after"] = load_text()
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out["quiet_rerun"] = ("HF_HUB_OFFLINE=1 vconsole bench kv-ideas --num-requests "
                          f"{num} --json  # on an otherwise idle machine")
    return out
