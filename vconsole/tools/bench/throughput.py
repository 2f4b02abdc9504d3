"""`vconsole bench throughput`: this engine against transformers, in the same process, as JSON.

One workload (64 requests, prompt lengths 32–256, output lengths 32–128, greedy, fixed seed,
token ids drawn from the model's vocabulary) on a built-in model (``--model-config``: ``tiny``,
4 layers × 256 hidden; ``small-gqa``, 8 layers × 512 hidden with 4 query heads per KV head;
``smollm2``, the real SmolLM2-135M-Instruct, 30 layers × 576 hidden, a 49,152-token vocabulary)
through (a) this engine (64 sequences and 1024 tokens a step, a KV pool that holds the whole
workload), (b) transformers `generate` in static batches of 16, (c) transformers
`generate_batch` (its continuous batching, given the same budget and a cache for the whole
workload). Every request runs to its fixed output length (``ignore_eos`` here; ``min_new_tokens``
and no EOS there). Tokens/s counts the output tokens each request asked for; a static batch runs
until its longest member is done, and the extra tokens it computes for the others are its waste,
not its output. `generate_batch` takes one `max_new_tokens` for all requests, so it is given the
longest and credited with every token it generates (the most favourable reading for it).

**Utilisation** (model-FLOP utilisation, `vconsole.tools.bench.flops`): the engine's useful
FLOP/s — 2 × the decoder layers' linear weights per token fed, 2 × vocab × hidden per token
sampled (the LM head), 4 × layers × heads × head_dim × (p + 1) for attention at position p —
over this machine's float32 matmul peak, the best ``torch.mm`` of 2048² matrices on the bench's
torch threads, measured before and after each contender; the run's best peak divides every
round (a peak a neighbour's job pulled down must not flatter the figure). transformers' two get
the same figure for the work they served (``hf_*.utilisation``), which puts all three on the
machine's scale: a goal ratio that needs more than the peak is not reachable by any engine.
``load_average`` (1-minute, at the round's start and end) says how busy the machine was. ``engine.utilisation``
is the whole workload over its elapsed time; ``decode_all`` the steps without a prefill token;
``decode_steady`` those of them whose batch is at least 3/4 of the run's widest (the
decode-heavy steady state the goal names), each over the steps' own time.

**Weights and KV storage** (issue #30): ``--quantization int8`` and ``--kv-cache-dtype X`` go
to the engine's config; ``engine.decode_step_ms`` (mean and median of the decode-only steps at
the steady batch, the ``decode_steady`` steps) compares KV formats at the same batch. Every
round also runs a **single stream** (`SINGLE_PROMPT` prompt tokens, `SINGLE_OUTPUT` output
tokens, ``ignore_eos``): ``single_stream.decode_tokens_per_s`` is its decode-only steps'
tokens over their own time, beside the weight bytes a token reads; with ``--quantization`` the
float32 engine runs the same stream in the same round (``single_stream_float32``).
``--peer llama-cpp`` (the ``llama-cpp`` extra) adds llama.cpp through ``llama_cpp.Llama`` on
the GGUF that ``smollm2`` is converted from (its own Q4_1 weights), with the bench's torch
threads: the same single stream, then the 64 requests one after another (llama-cpp-python
serves one sequence at a time); ``llama_cpp.use_extra_bufts`` is off, because the only extra
buffer type ggml has for Q4_1 is AMX's, whose tile loads die with SIGILL on VMs that do not
grant the AMX tile state (ggml's repacked layouts cover Q4_0, IQ4_NL, Q8_0 and the K-quants,
not Q4_1). ``--no-transformers`` skips transformers' two contenders (the weights goals do not
need them). ``--threads N`` sets torch's threads (and llama.cpp's) for the whole run.

Each of ``--runs`` rounds runs all three back to back (a fresh engine each round, so no round
reuses another's prefix cache), after one small warm-up of each; the JSON lists every round's
ratios and utilisation and their median and worst, since these machines swing by tens of
percent between rounds. The top-level ``engine`` / ``hf_*`` / ``ratio_*`` keys are the median
round's.

With ``--quantization``, the quantized engine then runs against float32 weights at each
``--concurrency`` level (default 1, 8 and 64; `throughput_quant`), the CPU's vector extensions
and the int8 path named.

One module per part: the workload (`throughput_workload`), our engine (`throughput_engine`),
the peers (`throughput_peers`), the report over the rounds (`throughput_report`); this one runs
the rounds.
"""


from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vconsole.engine.worker.model_loader import resolve_model_path
from vconsole.tools.bench.flops import ModelShape, matmul_peak_flops
from vconsole.tools.bench.throughput_engine import EngineOptions, run_engine, run_single_stream
from vconsole.tools.bench.throughput_peers import (
    llama_greedy,
    load_hf,
    load_llama_cpp,
    run_generate_batch,
    run_llama_cpp,
    run_static_generate,
)
from vconsole.tools.bench.throughput_report import ratio, summarise
from vconsole.tools.bench.throughput_workload import Workload, make_workload


@dataclass(frozen=True)
class RoundPlan:
    """Which contenders a round runs."""

    engine: EngineOptions
    transformers: bool = True
    llama_cpp: Any = None          # a loaded llama_cpp.Llama, or None


def _one_round(model: Any, model_dir: str, wl: Workload, shape: ModelShape, plan: RoundPlan,
               log: Callable[[str], None]) -> dict[str, Any]:
    # The peak before and after each contender, the best kept: one measurement taken while a
    # neighbour's job ran would understate it (and overstate the utilisation).
    load_start = os.getloadavg()[0]
    peaks = [matmul_peak_flops()]
    log("  engine ...")
    engine = run_engine(model_dir, wl, shape, plan.engine)
    peaks.append(matmul_peak_flops())
    out: dict[str, Any] = {"engine": engine}
    if plan.transformers:
        log("  transformers generate, static batches of 16 ...")
        static = run_static_generate(model, wl)
        static["gflops"] = round(wl.flops(shape) / static["elapsed_s"] / 1e9, 1)
        peaks.append(matmul_peak_flops())
        log("  transformers generate_batch ...")
        try:
            gb = run_generate_batch(model, wl)
            # Its useful work is what it served: every request to the longest output length.
            served = Workload(wl.prompts, [gb["max_new_tokens"]] * len(wl.prompts))
            gb["gflops"] = round(served.flops(shape) / gb["elapsed_s"] / 1e9, 1)
        except Exception as e:  # a peer failing must not hide our own figure
            gb = {"error": f"{type(e).__name__}: {e}"}
        peaks.append(matmul_peak_flops())
        out.update(hf_static=static, hf_generate_batch=gb)
    log("  engine, single stream ...")
    out["single_stream"] = run_single_stream(model_dir, shape, plan.engine)
    if plan.engine.quantization is not None:
        log("  engine, single stream, float32 weights ...")
        out["single_stream_float32"] = run_single_stream(
            model_dir, shape, EngineOptions(kv_cache_dtype=plan.engine.kv_cache_dtype))
    if plan.llama_cpp is not None:
        log("  llama.cpp: single stream, then the requests one by one ...")
        out["llama_cpp"] = run_llama_cpp(plan.llama_cpp, wl, shape)
    ours = engine["tokens_per_s"]
    single = out["single_stream"]["decode_tokens_per_s"]
    out.update({
        "peak_gflops": round(max(peaks) / 1e9, 1),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "ratio_vs_static": ratio(ours, out.get("hf_static", {}).get("tokens_per_s")),
        "ratio_vs_generate_batch": ratio(ours, out.get("hf_generate_batch", {})
                                          .get("tokens_per_s")),
        "single_stream_vs_float32": ratio(single, out.get("single_stream_float32", {})
                                           .get("decode_tokens_per_s")),
        "single_stream_vs_llama_cpp": ratio(single, out.get("llama_cpp", {})
                                             .get("single_stream", {})
                                             .get("decode_tokens_per_s")),
        "concurrent_vs_llama_cpp_sequential": ratio(ours, out.get("llama_cpp", {})
                                                     .get("sequential", {})
                                                     .get("tokens_per_s"))})
    return out


def _against_llama_server(args: argparse.Namespace, name: str,
                          log: Callable[[str], None]) -> dict[str, Any]:
    """``--peer llama-server``: both servers over HTTP (`vconsole.tools.bench.throughput_http`)
    on smollm2's GGUF; the in-process contenders do not run."""
    from vconsole.engine.worker.gguf_model import smollm2_gguf
    from vconsole.tools.bench.throughput_http import LEVELS, HttpPlan, http_throughput

    if name not in ("tiny", "smollm2"):        # tiny: the flag's default, not a choice
        raise SystemExit("vconsole bench: --peer llama-server runs smollm2's GGUF; "
                         f"--model-config {name} does not apply")
    try:
        gguf = smollm2_gguf()
    except ValueError as e:
        raise SystemExit(f"vconsole bench: {e}") from None
    plan = HttpPlan(gguf, getattr(args, "threads", None) or os.cpu_count() or 1,
                    tuple(getattr(args, "concurrency", None) or LEVELS),
                    getattr(args, "quantization", None), getattr(args, "base_port", 0) or 0)
    return http_throughput(plan, log)


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    name = getattr(args, "model_config", None) or "tiny"
    num_runs = getattr(args, "runs", None) or 5
    if num_runs < 1:
        raise SystemExit("vconsole bench: --runs must be at least 1")
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise SystemExit("vconsole bench: --threads must be at least 1")
        torch.set_num_threads(threads)
    peer = getattr(args, "peer", None)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    if peer == "llama-server":
        return _against_llama_server(args, name, log)
    if peer == "llama-cpp" and name != "smollm2":
        raise SystemExit("vconsole bench: --peer llama-cpp runs smollm2's GGUF; "
                         "pass --model-config smollm2")
    opts = EngineOptions(getattr(args, "quantization", None),
                         getattr(args, "kv_cache_dtype", None) or "auto")
    llm = load_llama_cpp(torch.get_num_threads()) if peer == "llama-cpp" else None
    plan = RoundPlan(opts, transformers=not getattr(args, "no_transformers", False),
                     llama_cpp=llm)
    model_dir = str(resolve_model_path(name))
    # gguf reads the model's GGUF file: its engines load it by name, the rest from its directory
    engine_model = name if opts.quantization == "gguf" else model_dir
    model = load_hf(model_dir) if plan.transformers else None
    if model is not None:
        shape = ModelShape.of(model.config)
    else:
        from transformers import AutoConfig

        shape = ModelShape.of(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    wl = make_workload(args.num_requests or 64, vocab=shape.vocab)
    result: dict[str, Any] = {"benchmark": "throughput", "model_config": name,
                              "num_requests": len(wl.prompts),
                              "output_tokens": wl.num_output_tokens,
                              "torch_threads": torch.get_num_threads(),
                              "quantization": opts.quantization,
                              "kv_cache_dtype": opts.kv_cache_dtype, "peer": peer,
                              "useful_gflop": round(wl.flops(shape) / 1e9, 3)}
    log("warm-up ...")
    warm = make_workload(2, seed=1, vocab=shape.vocab)
    run_engine(engine_model, Workload(warm.prompts, [8, 8]), shape, opts)
    if plan.transformers:
        run_static_generate(model, Workload(warm.prompts, [8, 8]))
    if llm is not None:
        llama_greedy(llm, warm.prompts[0], 8)
    rounds = []
    for i in range(num_runs):
        log(f"round {i + 1}/{num_runs}")
        rounds.append(_one_round(model, engine_model, wl, shape, plan, log))
    summarise(result, rounds, plan.transformers)
    if opts.quantization is not None:
        from vconsole.tools.bench.throughput_quant import LEVELS, quant_vs_float

        log(f"{opts.quantization} against float32 weights at each concurrency ...")
        result["vs_float32"] = quant_vs_float(
            engine_model, shape, opts.quantization,
            tuple(getattr(args, "concurrency", None) or LEVELS), num_runs, log)
    return result
