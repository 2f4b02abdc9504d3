"""Paired decode steps: the native decode step (`native_decode`) against the Python layers.

Run as ``python -m vconsole.tools.bench.decode_step [--json]``. One engine (SmolLM2's GGUF by
default, its blocks as stored) is given ``--rows`` greedy requests that never stop early and
stepped until every row decodes; then its decode steps alternate between the two paths, one
step natively, the next on `FusedDecoder`'s Python layers (the plan switched off for that step,
as ``VCONSOLE_DECODE_STEP=python`` does at start), ``--steps`` pairs, so the machine's load
falls on both alike. A step's time is `EngineCore.step`'s wall time (schedule, forward, LM head,
sampling, update); the report gives each path's median, the ratio, and tokens per second of
one stream at each median. The greedy tokens are the same either way (the tests check it), so
the requests' progress does not depend on the path a step took.

``--draft K`` makes every step a speculative one (#47): the engine speculates with K tokens, and
before each step every request is handed a draft of K tokens (its last token repeated: mostly
rejected, so each step feeds 1 + K rows per request and emits about one token), which the
native path runs as 1 + K decode rows of the request. ``native_share`` says which share of each
side's steps ran the native call (a step wider than `native_decode.MAX_ROWS` never does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests
from vconsole.engine.worker.native_decode import MAX_ROWS
from vconsole.shared.config import EngineConfig


def decode_step_bench(model: str = "smollm2", rows: int = 1, steps: int = 100,
                      prompt_tokens: int = 64, threads: int | None = None,
                      draft: int = 0) -> dict[str, Any]:
    if not 1 <= rows <= MAX_ROWS or steps < 1 or prompt_tokens < 1 or not 0 <= draft <= 8:
        raise ValueError(f"rows 1-{MAX_ROWS}, draft 0-8, steps and prompt tokens >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    spec = None if not draft else json.dumps(
        {"method": "ngram", "num_speculative_tokens": draft, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2})
    core = EngineCore(EngineConfig(model=model, device="cpu", max_num_seqs=rows,
                                   enable_prefix_caching=False, speculative_config=spec))
    fused = core.runner.fused_decoder
    if fused is None or fused.native is None:
        why = "no fused decoder" if fused is None else fused.native_reason
        raise RuntimeError(f"the native decode step does not run on this model: {why}")
    vocab = core.runner.vocab_size
    prompts = [[(37 * i + 11 * j) % (vocab - 10) + 5 for j in range(prompt_tokens)]
               for i in range(rows)]
    for req in greedy_requests(core, prompts, 2 * steps * (1 + draft) + 16, ignore_eos=True):
        core.add_request(req)
    while core.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    core.step()
    plan = fused.native
    times: dict[str, list[float]] = {"native": [], "python": []}
    ran_native: dict[str, int] = {"native": 0, "python": 0}
    for _ in range(steps):
        for path in ("native", "python"):
            fused.native = plan if path == "native" else None
            if draft:
                for req in core.scheduler.running:
                    req.spec_token_ids = [req.all_token_ids[-1]] * draft
            t = time.perf_counter()
            core.step()
            times[path].append(time.perf_counter() - t)
            ran_native[path] += fused.last_native
    fused.native = plan
    med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
    out = {"model": model, "weights": core.runner.weights or "float32", "rows": rows,
           "draft": draft, "rows_per_step": rows * (1 + draft),
           "steps": steps, "threads": torch.get_num_threads(),
           "load_average": list(os.getloadavg()),
           "step_ms": {p: round(v, 3) for p, v in med.items()},
           "native_share": {p: round(n / steps, 3) for p, n in ran_native.items()},
           "python_over_native": round(med["python"] / med["native"], 3)}
    if not draft:
        out["tokens_per_s"] = {p: round(1e3 * rows / v, 1) for p, v in med.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.bench.decode_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", default="1,4", help="requests decoding together, each level a "
                                                 f"run, 1-{MAX_ROWS} (default 1,4)")
    p.add_argument("--draft", type=int, default=0,
                   help="draft tokens per request and step: speculative steps of "
                        "rows x (1 + draft) rows (default 0: plain decode steps)")
    p.add_argument("--steps", type=int, default=100, help="step pairs a level (default 100)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = [decode_step_bench(args.model, int(r), args.steps, threads=args.threads,
                             draft=args.draft)
           for r in args.rows.split(",")]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for run in out:
            print(f"{run['rows_per_step']} row(s) a step ({run['rows']} request(s), draft "
                  f"{run['draft']}), {run['threads']} thread(s), {run['weights']}: "
                  f"native {run['step_ms']['native']:.2f} ms, python "
                  f"{run['step_ms']['python']:.2f} ms a step "
                  f"({run['python_over_native']:.2f}x; native share "
                  f"{run['native_share']['native']:.0%}), load {run['load_average'][0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
