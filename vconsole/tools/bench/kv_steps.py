"""Paired decode steps: the KV formats' whole decode steps against ``auto`` at the same batch.

Run as ``python -m vconsole.tools.bench.kv_steps [--json]``. One engine per format is built in
this one process (SmolLM2 by default), each is given the same requests (``--rows`` prompts of
``--prompt-tokens`` tokens, greedy, never stopping early) and stepped until every row decodes;
then the engines' decode steps are **interleaved**, one step of each in turn, ``--steps``
rounds, so that the machine's load (other jobs, frequency changes) falls on every format
alike. A step's time is `EngineCore.step`'s wall time; the report gives each format's median
and its ratio to ``auto``'s median in the same run (the issue's goal: at most 1.05x).
Back-to-back runs of ``bench throughput`` under a shared machine's load differed by 5x for the
same format, which is why the steps are paired here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests
from vconsole.shared.config import EngineConfig

FORMATS = ("auto", "int8_per_token_head", "int8_kivi", "int4_kivi")


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(37 * i + 11 * j) % (vocab - 10) + 5 for j in range(n)]


def kv_steps_bench(model: str = "smollm2", rows: int = 16, prompt_tokens: int = 300,
                   steps: int = 24, formats: tuple[str, ...] = FORMATS) -> dict[str, Any]:
    if rows < 1 or prompt_tokens < 1 or steps < 1:
        raise ValueError("rows, prompt tokens and steps must be >= 1")
    if formats[0] != "auto":
        raise ValueError("the first format must be auto: the ratios are against it")
    blocks_per_row = -(-(prompt_tokens + steps + 64) // 16)
    cores: dict[str, EngineCore] = {}
    for name in formats:
        core = EngineCore(EngineConfig(model=model, device="cpu", dtype="float32",
                                       kv_cache_dtype=name, max_num_seqs=rows,
                                       # a per-channel format's rows hold one block more
                                       # each, for their open block's keys (#48)
                                       num_kv_blocks=rows * (blocks_per_row + 1) + 8,
                                       enable_prefix_caching=False))
        vocab = core.runner.vocab_size
        prompts = [_prompt(i, prompt_tokens, vocab) for i in range(rows)]
        for req in greedy_requests(core, prompts, steps + 48, ignore_eos=True):
            core.add_request(req)
        # Prefill every row, then one step more: from here on every step decodes all rows.
        while core.scheduler.num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
            core.step()
        core.step()
        cores[name] = core
    times: dict[str, list[float]] = {name: [] for name in formats}
    for _ in range(steps):
        for name, core in cores.items():
            t = time.perf_counter()
            core.step()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["auto"])
    out: dict[str, Any] = {"benchmark": "kv-steps", "model": model, "rows": rows,
                           "prompt_tokens": prompt_tokens, "steps": steps, "formats": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out["formats"][name] = {"decode_step_ms_median": med * 1e3,
                                "decode_step_ms_min": min(ts) * 1e3,
                                "vs_auto": med / base,
                                "blocks": cores[name].num_kv_blocks}
    for core in cores.values():
        core.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.bench.kv_steps",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma-separated kv_cache_dtype values, auto first")
    p.add_argument("--json", action="store_true", help="print the JSON only")
    args = p.parse_args(argv)
    try:
        out = kv_steps_bench(args.model, args.rows, args.prompt_tokens, args.steps,
                             tuple(args.formats.split(",")))
    except ValueError as e:
        print(f"kv-steps: {e}", file=sys.stderr)
        return 2
    if not args.json:
        for name, f in out["formats"].items():
            print(f"{name:>22}: {f['decode_step_ms_median']:7.1f} ms  {f['vs_auto']:.2f}x auto",
                  file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
