"""`bench throughput`'s engine contender: the workload through an in-process `EngineCore`
(each step's useful FLOPs recorded from the scheduler's output, the decode-only steps' rates),
and the single stream alone in the engine."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.shared.config import EngineConfig
from vconsole.tools.bench.flops import ModelShape
from vconsole.tools.bench.throughput_workload import (
    BLOCK_SIZE,
    SINGLE_OUTPUT,
    Workload,
    kv_blocks_for,
    make_workload,
    single_prompt,
)


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
    bytes_per_weight = float(core.model_dims()["weight_bytes"])    # int8 1, Q4_1 0.625
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
