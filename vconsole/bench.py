"""`vconsole bench NAME`: benchmarks that compare against a peer in the same run and print JSON.

throughput — one workload (64 requests, prompt lengths 32–256, output lengths 32–128, greedy,
fixed seed, the tiny 4-layer × 256-hidden model) through (a) this engine, (b) transformers
`generate` in static batches of 16, (c) transformers `generate_batch` (its continuous batching).
Tokens/s counts the output tokens each request asked for; a static batch runs until its longest
member is done, and the extra tokens it computes for the others are its waste, not its output.
`generate_batch` takes one `max_new_tokens` for all requests, so it is given the longest and
credited with every token it generates (the most favourable reading for it).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from vconsole.engine.config import EngineConfig
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker.tiny_model import ensure_tiny_model


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
    warm = greedy_requests(core, wl.prompts[:2], 4, ignore_eos=True, prefix="warm")
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

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model.eval()
    return model


def run_static_generate(model_dir: str, wl: Workload, batch_size: int = 16) -> dict[str, Any]:
    model = _load_hf(model_dir)
    pad = model.generation_config.pad_token_id or 0
    t0 = time.perf_counter()
    computed = 0
    with torch.inference_mode():
        for start in range(0, len(wl.prompts), batch_size):
            batch = wl.prompts[start:start + batch_size]
            lens = wl.output_lens[start:start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(lens)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=pad)
            computed += n * len(batch)
    elapsed = time.perf_counter() - t0
    return {"tokens": wl.num_output_tokens, "tokens_computed": computed,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(wl.num_output_tokens / elapsed, 1), "batch_size": batch_size}


def run_generate_batch(model_dir: str, wl: Workload) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = _load_hf(model_dir)
    n = max(wl.output_lens)
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=model.generation_config.pad_token_id)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=wl.prompts, generation_config=gen)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1), "max_new_tokens": n}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = str(ensure_tiny_model())
    wl = make_workload(args.num_requests or 64)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    result: dict[str, Any] = {"benchmark": "throughput", "num_requests": len(wl.prompts),
                              "output_tokens": wl.num_output_tokens,
                              "torch_threads": torch.get_num_threads()}
    log("engine ...")
    result["engine"] = run_engine(model_dir, wl)
    log("transformers generate, static batches of 16 ...")
    result["hf_static"] = run_static_generate(model_dir, wl)
    log("transformers generate_batch ...")
    try:
        result["hf_generate_batch"] = run_generate_batch(model_dir, wl)
    except Exception as e:  # a peer failing must not hide our own figure
        result["hf_generate_batch"] = {"error": f"{type(e).__name__}: {e}"}
    ours = result["engine"]["tokens_per_s"]
    result["ratio_vs_static"] = round(ours / result["hf_static"]["tokens_per_s"], 2)
    gb = result["hf_generate_batch"].get("tokens_per_s")
    result["ratio_vs_generate_batch"] = round(ours / gb, 2) if gb else None
    result["goal"] = {"vs_static": 2.0, "vs_generate_batch": 5.0}
    return result


