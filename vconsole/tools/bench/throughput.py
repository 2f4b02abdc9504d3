"""`vconsole bench throughput`: this engine against transformers, in the same process, as JSON.

One workload (64 requests, prompt lengths 32–256, output lengths 32–128, greedy, fixed seed) on a
built-in model (``--model-config``: ``tiny``, 4 layers × 256 hidden, or ``small-gqa``, 8 layers ×
512 hidden with 4 query heads per KV head) through (a) this engine, (b) transformers `generate`
in static batches of 16, (c) transformers `generate_batch` (its continuous batching).
Tokens/s counts the output tokens each request asked for; a static batch runs until its longest
member is done, and the extra tokens it computes for the others are its waste, not its output.
`generate_batch` takes one `max_new_tokens` for all requests, so it is given the longest and
credited with every token it generates (the most favourable reading for it).

Each of ``--runs`` rounds runs all three back to back (a fresh engine each round, so no round
reuses another's prefix cache), after one small warm-up of each; the JSON lists every round's
ratios and their median and worst, since these machines swing by tens of percent between
rounds. The top-level ``engine`` / ``hf_*`` / ``ratio_*`` keys are the median round's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker.tiny_model import ensure_model
from vconsole.shared.config import EngineConfig


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int = 64, seed: int = 0, vocab: int = 250) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(32, 128) for _ in range(num_requests)])


def run_engine(model_dir: str, wl: Workload) -> dict[str, Any]:
    core = EngineCore(EngineConfig(model=model_dir, device="cpu", dtype="float32",
                                   max_num_seqs=64, max_num_batched_tokens=1024))
    # Prompts of their own: the measured ones must not find anything in the prefix cache.
    warm = greedy_requests(core, make_workload(2, seed=99).prompts, 4, ignore_eos=True,
                           prefix="warm")
    run_batch(core, warm)
    reqs = greedy_requests(core, wl.prompts, wl.output_lens, ignore_eos=True)
    res = run_batch(core, reqs, keep_step_log=True)
    assert res.num_output_tokens == wl.num_output_tokens
    phases = {k: sum(getattr(s, f"{k}_ns") for s in res.step_log) / 1e9
              for k in ("schedule", "execute", "update")}
    return {"tokens": res.num_output_tokens, "elapsed_s": round(res.elapsed_s, 3),
            "tokens_per_s": round(res.tokens_per_s, 1), "steps": res.num_steps,
            "preemptions": res.num_preemptions,
            "phase_s": {k: round(v, 3) for k, v in phases.items()}}


def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # --json: nothing on stderr

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model.eval()
    return model


def run_static_generate(model: Any, wl: Workload, batch_size: int = 16,
                        device: str = "cpu") -> dict[str, Any]:
    pad = model.generation_config.pad_token_id or 0
    t0 = time.perf_counter()
    computed = 0
    with torch.inference_mode():
        for start in range(0, len(wl.prompts), batch_size):
            batch = wl.prompts[start:start + batch_size]
            lens = wl.output_lens[start:start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                device=device)
            n = max(lens)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=pad)
            computed += n * len(batch)
    elapsed = time.perf_counter() - t0
    return {"tokens": wl.num_output_tokens, "tokens_computed": computed,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(wl.num_output_tokens / elapsed, 1), "batch_size": batch_size}


def run_generate_batch(model: Any, wl: Workload) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    n = max(wl.output_lens)
    # eos -1: never stop early (what transformers sets itself for None, with a warning).
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    # Our engine's budget (64 sequences, 1024 tokens a step) and a cache that holds the whole
    # workload at once. Left to infer its cache from free memory, it takes most of a CPU box's
    # RAM (13 GB on a 24 GB machine) and spends its time setting it up.
    page = 256
    blocks = sum(-(-(len(p) + n) // page) for p in wl.prompts) + 8
    cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=1024,
                                  max_requests_per_batch=64)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=wl.prompts, generation_config=gen,
                                   continuous_batching_config=cb)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1), "max_new_tokens": n,
            "num_blocks": blocks, "max_batch_tokens": 1024}


GOAL = {"median_vs_static": 3.0, "median_vs_generate_batch": 8.0, "worst_vs_static": 2.0}


def _ratio(ours: float, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if theirs else None


def _one_round(model, model_dir: str, wl: Workload, log: Callable[[str], None]) -> dict[str, Any]:
    log("  engine ...")
    engine = run_engine(model_dir, wl)
    log("  transformers generate, static batches of 16 ...")
    static = run_static_generate(model, wl)
    log("  transformers generate_batch ...")
    try:
        gb = run_generate_batch(model, wl)
    except Exception as e:  # a peer failing must not hide our own figure
        gb = {"error": f"{type(e).__name__}: {e}"}
    ours = engine["tokens_per_s"]
    return {"engine": engine, "hf_static": static, "hf_generate_batch": gb,
            "ratio_vs_static": _ratio(ours, static["tokens_per_s"]),
            "ratio_vs_generate_batch": _ratio(ours, gb.get("tokens_per_s"))}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    name = getattr(args, "model_config", None) or "tiny"
    num_runs = getattr(args, "runs", None) or 5
    if num_runs < 1:
        raise SystemExit("vconsole bench: --runs must be at least 1")
    model_dir = str(ensure_model(name))
    wl = make_workload(args.num_requests or 64)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    result: dict[str, Any] = {"benchmark": "throughput", "model_config": name,
                              "num_requests": len(wl.prompts),
                              "output_tokens": wl.num_output_tokens,
                              "torch_threads": torch.get_num_threads()}
    model = _load_hf(model_dir)
    log("warm-up ...")
    warm = make_workload(2, seed=1)
    _one_round(model, model_dir, Workload(warm.prompts, [8, 8]), lambda m: None)
    rounds = []
    for i in range(num_runs):
        log(f"round {i + 1}/{num_runs}")
        rounds.append(_one_round(model, model_dir, wl, log))
    static = [r["ratio_vs_static"] for r in rounds]
    gb = [r["ratio_vs_generate_batch"] for r in rounds if r["ratio_vs_generate_batch"]]
    result["runs"] = [{"engine_tokens_per_s": r["engine"]["tokens_per_s"],
                       "static_tokens_per_s": r["hf_static"]["tokens_per_s"],
                       "generate_batch_tokens_per_s": r["hf_generate_batch"].get("tokens_per_s"),
                       "ratio_static": r["ratio_vs_static"],
                       "ratio_generate_batch": r["ratio_vs_generate_batch"]} for r in rounds]
    # The median round (by the static ratio) fills the keys of a single-round report.
    median_round = sorted(rounds, key=lambda r: r["ratio_vs_static"])[(len(rounds) - 1) // 2]
    result.update(median_round)
    result["median_ratio_static"] = round(statistics.median(static), 2)
    result["worst_ratio_static"] = min(static)
    result["median_ratio_generate_batch"] = round(statistics.median(gb), 2) if gb else None
    result["worst_ratio_generate_batch"] = min(gb) if gb else None
    met = {"median_vs_static": result["median_ratio_static"] >= GOAL["median_vs_static"],
           "median_vs_generate_batch": bool(gb) and result["median_ratio_generate_batch"]
           >= GOAL["median_vs_generate_batch"],
           "worst_vs_static": result["worst_ratio_static"] >= GOAL["worst_vs_static"]}
    result["goal"] = {**GOAL, "met": met, "all_met": all(met.values())}
    return result
