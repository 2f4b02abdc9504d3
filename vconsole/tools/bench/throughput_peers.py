"""`bench throughput`'s peers, run in this process on the same workload: transformers
(`generate` in static batches, and `generate_batch`, its continuous batching) and llama.cpp
(``llama_cpp.Llama`` on smollm2's GGUF: the single stream, then the requests one by one)."""

from __future__ import annotations

import time
from typing import Any

import torch

from vconsole.tools.bench.flops import ModelShape
from vconsole.tools.bench.throughput_workload import (
    SINGLE_OUTPUT,
    SINGLE_PROMPT,
    Workload,
    single_prompt,
)

LLAMA_CPP_INSTALL = "pip install 'vconsole[llama-cpp]' (builds llama-cpp-python)"


def load_llama_cpp(threads: int, n_ctx: int = 1024) -> Any:
    """llama.cpp (``llama_cpp.Llama``) on smollm2's GGUF with ``threads`` threads, extra
    buffer types off (see `vconsole.tools.bench.throughput`). SystemExit with the install line when
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


def llama_greedy(llm: Any, prompt: list[int], output_len: int) -> tuple[float, float]:
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
    prefill, decode = llama_greedy(llm, single_prompt(shape.vocab), output_len)
    t0 = time.perf_counter()
    for prompt, n in zip(wl.prompts, wl.output_lens, strict=True):
        llama_greedy(llm, prompt, n)
    elapsed = time.perf_counter() - t0
    return {"single_stream": {"prompt_tokens": SINGLE_PROMPT, "output_tokens": output_len,
                              "prefill_s": round(prefill, 4),
                              "decode_tokens_per_s": round((output_len - 1) / decode, 1)},
            "sequential": {"tokens": wl.num_output_tokens, "elapsed_s": round(elapsed, 3),
                           "tokens_per_s": round(wl.num_output_tokens / elapsed, 1)},
            "n_threads": llm.n_threads}


def load_hf(model_dir: str) -> Any:
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
