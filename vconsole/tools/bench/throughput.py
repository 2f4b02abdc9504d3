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
"""

from __future__ import annotations

import argparse
import os
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
from vconsole.engine.worker.model_loader import resolve_model_path
from vconsole.shared.config import EngineConfig
from vconsole.tools.bench.flops import ModelShape, matmul_peak_flops


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def flops(self, shape: ModelShape) -> int:
        """Useful FLOPs of serving the whole workload once (`ModelShape.request_flops`)."""
        return sum(shape.request_flops(len(p), n)
                   for p, n in zip(self.prompts, self.output_lens, strict=True))


def make_workload(num_requests: int = 64, seed: int = 0, vocab: int = 250) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(32, 128) for _ in range(num_requests)])


BLOCK_SIZE = 16


def kv_blocks_for(wl: Workload, block_size: int = BLOCK_SIZE) -> int:
    """A pool that holds every request of the workload at once (no preemption), plus slack."""
    return sum(-(-(len(p) + n) // block_size)
               for p, n in zip(wl.prompts, wl.output_lens, strict=True)) + 64


class StepFlops:
    """Records each step's useful FLOPs (`ModelShape.step_flops`) from the scheduler's output,
    by wrapping ``core.scheduler.schedule``: the bench observes, the engine is unchanged. Exact
    for steps without prefill tokens, where every scheduled row samples one token."""

    def __init__(self, core: EngineCore, shape: ModelShape) -> None:
        self.flops: list[int] = []
        schedule = core.scheduler.schedule

        def recording() -> Any:
            so = schedule()
            self.flops.append(shape.step_flops(so.start_positions(), so.num_scheduled_tokens,
                                               so.num_decode_tokens))
            return so

        core.scheduler.schedule = recording  # type: ignore[method-assign]


STEADY_SHARE = 0.75   # "steady state": decode-only steps with >= 3/4 of the largest batch


def decode_rates(step_log: list[Any], flops: list[int]) -> dict[str, Any]:
    """Useful FLOP/s of the decode-only steps (no prefill token in the step), all of them and
    the steady state: those whose batch is at least `STEADY_SHARE` of the largest. Time is the
    steps' own (schedule + execute + update)."""
    decode = [(s, f) for s, f in zip(step_log, flops, strict=True)
              if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    if not decode:
        return {}
    widest = max(s.num_decode_tokens for s, _ in decode)

    def figures(steps: list[tuple[Any, int]]) -> dict[str, Any]:
        seconds = sum(s.total_ns for s, _ in steps) / 1e9
        rate = sum(f for _, f in steps) / seconds
        rows = sorted(s.num_decode_tokens for s, _ in steps)
        return {"steps": len(steps), "seconds": round(seconds, 3),
                "median_rows": rows[len(rows) // 2],
                "ms_per_step": round(1e3 * seconds / len(steps), 2),
                "median_ms_per_step": round(statistics.median(s.total_ns for s, _ in steps)
                                            / 1e6, 2),
                "gflops": round(rate / 1e9, 1)}

    return {"decode_all": figures(decode),
            "decode_steady": figures([(s, f) for s, f in decode
                                      if s.num_decode_tokens >= STEADY_SHARE * widest])}


@dataclass(frozen=True)
class EngineOptions:
    """What the engine contender runs with beyond the workload (``bench throughput`` flags)."""

    quantization: str | None = None
    kv_cache_dtype: str = "auto"


def _engine(model_dir: str, wl: Workload, opts: EngineOptions, max_num_seqs: int = 64,
            max_num_batched_tokens: int = 1024) -> EngineCore:
    return EngineCore(EngineConfig(model=model_dir, device="cpu", dtype="float32",
                                   max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   block_size=BLOCK_SIZE, num_kv_blocks=kv_blocks_for(wl),
                                   quantization=opts.quantization,
                                   kv_cache_dtype=opts.kv_cache_dtype))


def run_engine(model_dir: str, wl: Workload, shape: ModelShape,
               opts: EngineOptions = EngineOptions(), max_num_seqs: int = 64,
               max_num_batched_tokens: int = 1024) -> dict[str, Any]:
    core = _engine(model_dir, wl, opts, max_num_seqs, max_num_batched_tokens)
    # Prompts of their own: the measured ones must not find anything in the prefix cache.
    warm = greedy_requests(core, make_workload(2, seed=99, vocab=shape.vocab).prompts, 4,
                           ignore_eos=True, prefix="warm")
    run_batch(core, warm)
    recorder = StepFlops(core, shape)
    reqs = greedy_requests(core, wl.prompts, wl.output_lens, ignore_eos=True)
    res = run_batch(core, reqs, keep_step_log=True)
    assert res.num_output_tokens == wl.num_output_tokens
    phases = {k: sum(getattr(s, f"{k}_ns") for s in res.step_log) / 1e9
              for k in ("schedule", "execute", "update")}
    rate = wl.flops(shape) / res.elapsed_s
    out = {"tokens": res.num_output_tokens, "elapsed_s": round(res.elapsed_s, 3),
           "tokens_per_s": round(res.tokens_per_s, 1), "steps": res.num_steps,
           "preemptions": res.num_preemptions,
           "phase_s": {k: round(v, 3) for k, v in phases.items()},
           "gflops": round(rate / 1e9, 2), **decode_rates(res.step_log, recorder.flops)}
    steady = out.get("decode_steady")
    if steady:
        out["decode_step_ms"] = {"mean": steady["ms_per_step"],
                                 "median": steady["median_ms_per_step"],
                                 "rows": steady["median_rows"]}
    out["quantization"] = opts.quantization
    out["kv_cache_dtype"] = core.runner.kv_cache_dtype
    return out


SINGLE_PROMPT = 128
SINGLE_OUTPUT = 256


def single_prompt(vocab: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(SINGLE_PROMPT)]


def run_single_stream(model_dir: str, shape: ModelShape, opts: EngineOptions,
                      output_len: int = SINGLE_OUTPUT) -> dict[str, Any]:
    """One request alone in the engine: the single user's latency. Decode tokens/s counts the
    decode-only steps (one token each) over their own time; the prefill step is reported
    apart."""
    prompt = single_prompt(shape.vocab)
    wl = Workload([prompt], [output_len])
    core = _engine(model_dir, wl, opts)
    run_batch(core, greedy_requests(core, [prompt[:16]], 8, ignore_eos=True, prefix="warm"))
    res = run_batch(core, greedy_requests(core, [prompt], output_len, ignore_eos=True),
                    keep_step_log=True)
    decode = [s.total_ns / 1e9 for s in res.step_log
              if s.num_prefill_tokens == 0 and s.num_decode_tokens == 1]
    prefill = sum(s.total_ns for s in res.step_log if s.num_prefill_tokens) / 1e9
    bytes_per_weight = 1 if opts.quantization == "int8" else 4
    weight_bytes = shape.weight_bytes_per_token(bytes_per_weight)
    rate = len(decode) / sum(decode)
    return {"prompt_tokens": len(prompt), "output_tokens": res.num_output_tokens,
            "elapsed_s": round(res.elapsed_s, 3), "prefill_s": round(prefill, 4),
            "decode_tokens_per_s": round(rate, 1),
            "decode_ms_per_token": {"mean": round(1e3 * sum(decode) / len(decode), 2),
                                    "median": round(1e3 * statistics.median(decode), 2)},
            "weight_mb_per_token": round(weight_bytes / 1e6, 1),
            "weight_gb_per_s": round(weight_bytes * rate / 1e9, 2),
            "quantization": opts.quantization, "kv_cache_dtype": core.runner.kv_cache_dtype}


LLAMA_CPP_INSTALL = "pip install 'vconsole[llama-cpp]' (builds llama-cpp-python)"


def load_llama_cpp(threads: int, n_ctx: int = 1024) -> Any:
    """llama.cpp (``llama_cpp.Llama``) on smollm2's GGUF with ``threads`` threads, extra
    buffer types off (see the module docstring). SystemExit with the install line when
    llama-cpp-python is missing."""
    try:
        import llama_cpp
        import llama_cpp.llama as llama_module
    except ImportError:
        raise SystemExit("vconsole bench: --peer llama-cpp needs llama-cpp-python: "
                         f"{LLAMA_CPP_INSTALL}") from None
    from vconsole.engine.worker.gguf_model import smollm2_gguf

    low = llama_module.llama_cpp        # llama_cpp.llama reads its defaults from here
    defaults = low.llama_model_default_params

    def no_extra_bufts() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(smollm2_gguf()), n_threads=threads,
                               n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, seed=0,
                               verbose=False)
    finally:
        low.llama_model_default_params = defaults


def _llama_greedy(llm: Any, prompt: list[int], output_len: int) -> tuple[float, float]:
    """One request from an empty context: ``(prefill seconds, decode seconds)`` for
    ``output_len`` greedy tokens (the first sampled from the prompt's logits, each later one
    fed back; no EOS stop)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for i in range(output_len):
        token = llm.sample(temp=0.0)
        if i < output_len - 1:
            llm.eval([token])
    return t1 - t0, time.perf_counter() - t1


def run_llama_cpp(llm: Any, wl: Workload, shape: ModelShape,
                  output_len: int = SINGLE_OUTPUT) -> dict[str, Any]:
    """The single stream (same prompt and length as the engine's) and the workload's requests
    one after another."""
    prefill, decode = _llama_greedy(llm, single_prompt(shape.vocab), output_len)
    t0 = time.perf_counter()
    for prompt, n in zip(wl.prompts, wl.output_lens, strict=True):
        _llama_greedy(llm, prompt, n)
    elapsed = time.perf_counter() - t0
    return {"single_stream": {"prompt_tokens": SINGLE_PROMPT, "output_tokens": output_len,
                              "prefill_s": round(prefill, 4),
                              "decode_tokens_per_s": round((output_len - 1) / decode, 1)},
            "sequential": {"tokens": wl.num_output_tokens, "elapsed_s": round(elapsed, 3),
                           "tokens_per_s": round(wl.num_output_tokens / elapsed, 1)},
            "n_threads": llm.n_threads}


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


GOAL = {"median_vs_static": 3.0, "median_vs_generate_batch": 8.0, "worst_vs_static": 2.0,
        "steady_utilisation": 0.6}
# Issue #30's weights goals: the int8 single stream against float32's and llama.cpp's Q4_1, and
# 64 concurrent requests against llama.cpp serving them one after another.
WEIGHTS_GOAL = {"single_stream_vs_float32": 2.0, "single_stream_vs_llama_cpp": 0.8,
                "concurrent_vs_llama_cpp_sequential": 5.0}


@dataclass(frozen=True)
class RoundPlan:
    """Which contenders a round runs."""

    engine: EngineOptions
    transformers: bool = True
    llama_cpp: Any = None          # a loaded llama_cpp.Llama, or None


def _add_utilisation(result: dict[str, Any], peak_gflops: float) -> None:
    """``utilisation`` (useful FLOP/s over the peak) beside each ``gflops`` of a contender's
    result (the engine's decode parts included)."""
    for part in (result, result.get("decode_all"), result.get("decode_steady")):
        if part and "gflops" in part:
            part["utilisation"] = round(part["gflops"] / peak_gflops, 3)


def _ratio(ours: float, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if theirs else None


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
        "ratio_vs_static": _ratio(ours, out.get("hf_static", {}).get("tokens_per_s")),
        "ratio_vs_generate_batch": _ratio(ours, out.get("hf_generate_batch", {})
                                          .get("tokens_per_s")),
        "single_stream_vs_float32": _ratio(single, out.get("single_stream_float32", {})
                                           .get("decode_tokens_per_s")),
        "single_stream_vs_llama_cpp": _ratio(single, out.get("llama_cpp", {})
                                             .get("single_stream", {})
                                             .get("decode_tokens_per_s")),
        "concurrent_vs_llama_cpp_sequential": _ratio(ours, out.get("llama_cpp", {})
                                                     .get("sequential", {})
                                                     .get("tokens_per_s"))})
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


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
    if peer == "llama-cpp" and name != "smollm2":
        raise SystemExit("vconsole bench: --peer llama-cpp runs smollm2's GGUF; "
                         "pass --model-config smollm2")
    opts = EngineOptions(getattr(args, "quantization", None),
                         getattr(args, "kv_cache_dtype", None) or "auto")
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    llm = load_llama_cpp(torch.get_num_threads()) if peer == "llama-cpp" else None
    plan = RoundPlan(opts, transformers=not getattr(args, "no_transformers", False),
                     llama_cpp=llm)
    model_dir = str(resolve_model_path(name))
    model = _load_hf(model_dir) if plan.transformers else None
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
    run_engine(model_dir, Workload(warm.prompts, [8, 8]), shape, opts)
    if plan.transformers:
        run_static_generate(model, Workload(warm.prompts, [8, 8]))
    if llm is not None:
        _llama_greedy(llm, warm.prompts[0], 8)
    rounds = []
    for i in range(num_runs):
        log(f"round {i + 1}/{num_runs}")
        rounds.append(_one_round(model, model_dir, wl, shape, plan, log))
    # One peak for the whole run, the best any round measured: a round whose peak a neighbour's
    # load pulled down must not flatter its utilisation.
    peak = max(r["peak_gflops"] for r in rounds)
    for r in rounds:
        for key in ("engine", "hf_static", "hf_generate_batch"):
            if key in r:
                _add_utilisation(r[key], peak)
    result["peak_gflops"] = peak
    result["runs"] = [{"engine_tokens_per_s": r["engine"]["tokens_per_s"],
                       "static_tokens_per_s": r.get("hf_static", {}).get("tokens_per_s"),
                       "generate_batch_tokens_per_s": r.get("hf_generate_batch", {})
                       .get("tokens_per_s"),
                       "ratio_static": r["ratio_vs_static"],
                       "ratio_generate_batch": r["ratio_vs_generate_batch"],
                       "decode_step_ms": r["engine"].get("decode_step_ms"),
                       "single_stream_tokens_per_s": r["single_stream"]["decode_tokens_per_s"],
                       "single_stream_float32_tokens_per_s": r.get("single_stream_float32", {})
                       .get("decode_tokens_per_s"),
                       "llama_cpp_single_stream_tokens_per_s": r.get("llama_cpp", {})
                       .get("single_stream", {}).get("decode_tokens_per_s"),
                       "llama_cpp_sequential_tokens_per_s": r.get("llama_cpp", {})
                       .get("sequential", {}).get("tokens_per_s"),
                       "single_stream_vs_float32": r["single_stream_vs_float32"],
                       "single_stream_vs_llama_cpp": r["single_stream_vs_llama_cpp"],
                       "concurrent_vs_llama_cpp_sequential":
                           r["concurrent_vs_llama_cpp_sequential"],
                       "peak_gflops": r["peak_gflops"], "load_average": r["load_average"],
                       "utilisation": r["engine"]["utilisation"],
                       "steady_utilisation": r["engine"].get("decode_steady", {})
                       .get("utilisation")} for r in rounds]
    # The median round (by the static ratio, or the engine's rate without transformers) fills
    # the keys of a single-round report.
    order: Callable[[dict[str, Any]], float] = (
        (lambda r: r["ratio_vs_static"]) if plan.transformers
        else (lambda r: r["engine"]["tokens_per_s"]))
    median_round = sorted(rounds, key=order)[(len(rounds) - 1) // 2]
    result.update({k: v for k, v in median_round.items() if k != "peak_gflops"})
    steady = [u for r in result["runs"] if (u := r["steady_utilisation"]) is not None]
    result["median_utilisation"] = round(statistics.median(r["utilisation"]
                                                           for r in result["runs"]), 3)
    result["median_steady_utilisation"] = round(statistics.median(steady), 3) if steady else None
    result["median_single_stream_tokens_per_s"] = _median(
        [r["single_stream_tokens_per_s"] for r in result["runs"]])
    weights = {k: _median([r[k] for r in result["runs"]]) for k in WEIGHTS_GOAL}
    result.update({f"median_{k}": v for k, v in weights.items()})
    if plan.transformers:
        static = [r["ratio_vs_static"] for r in rounds]
        gb = [r["ratio_vs_generate_batch"] for r in rounds if r["ratio_vs_generate_batch"]]
        result["median_ratio_static"] = round(statistics.median(static), 2)
        result["worst_ratio_static"] = min(static)
        result["median_ratio_generate_batch"] = round(statistics.median(gb), 2) if gb else None
        result["worst_ratio_generate_batch"] = min(gb) if gb else None
        met = {"median_vs_static": result["median_ratio_static"] >= GOAL["median_vs_static"],
               "median_vs_generate_batch": bool(gb) and result["median_ratio_generate_batch"]
               >= GOAL["median_vs_generate_batch"],
               "worst_vs_static": result["worst_ratio_static"] >= GOAL["worst_vs_static"],
               "steady_utilisation": bool(steady) and result["median_steady_utilisation"]
               >= GOAL["steady_utilisation"]}
        result["goal"] = {**GOAL, "met": met, "all_met": all(met.values())}
    measured = {k: v for k, v in weights.items() if v is not None}
    if measured:
        met = {k: v >= WEIGHTS_GOAL[k] for k, v in measured.items()}
        result["weights_goal"] = {**{k: WEIGHTS_GOAL[k] for k in measured}, "met": met,
                                  "all_met": all(met.values())}
    return result
