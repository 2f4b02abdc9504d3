"""`bench throughput --quantization Q`: the quantized engine against float32 weights at each
concurrency (issue #49's yardstick), on the CPU it names.

At each level ``c`` of ``--concurrency`` (default `LEVELS`: one stream, 8 and 64), an engine
with ``max_num_seqs = c`` serves `REQUESTS_PER_SEAT` x ``c`` requests of the bench's workload
(a fresh set per level, the same for both weights), submitted at once, so ``c`` run side by
side until the queue drains. Both weights run in each round, quantized first in odd rounds and
float32 first in even ones (a drift of the machine's speed over a round falls on both sides);
output tokens over the wall time of the whole set is the figure, its ratio quantized over
float32 the verdict, and the median round is reported with every round kept.

The goal (issue #49): the quantized weights at least as fast as float32 at every level and
1.8x at one stream. The report names the CPU's vector extensions and the path the many-row
int8 matmuls take here (`weight_quant.predicted_path`), since that is what the figure depends
on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.tools.bench.cpu_features import cpu_description
from vconsole.tools.bench.flops import ModelShape
from vconsole.tools.bench.throughput_engine import EngineOptions, _engine
from vconsole.tools.bench.throughput_report import ratio
from vconsole.tools.bench.throughput_workload import Workload, make_workload

LEVELS = (1, 8, 64)
REQUESTS_PER_SEAT = 2
GOAL = {"every_level": 1.0, "one_stream": 1.8}


def _serve(model_dir: str, wl: Workload, shape: ModelShape, opts: EngineOptions,
           seats: int) -> dict[str, Any]:
    """``wl`` through a fresh engine with ``seats`` running requests at most."""
    core = _engine(model_dir, wl, opts, max_num_seqs=seats,
                   max_num_batched_tokens=max(256, 4 * seats))
    warm = make_workload(2, seed=99, vocab=shape.vocab)
    run_batch(core, greedy_requests(core, warm.prompts, 4, ignore_eos=True, prefix="warm"))
    res = run_batch(core, greedy_requests(core, wl.prompts, wl.output_lens, ignore_eos=True))
    assert res.num_output_tokens == wl.num_output_tokens
    return {"tokens_per_s": round(res.tokens_per_s, 1), "elapsed_s": round(res.elapsed_s, 2),
            "steps": res.num_steps}


def _path() -> str:
    from vconsole.engine.worker.weight_quant import predicted_path

    try:
        p = predicted_path()
    except ValueError as e:
        return str(e)
    return p.describe() + (f" ({p.why})" if p.why else "")


def quant_vs_float(model_dir: str, shape: ModelShape, quantization: str,
                   levels: tuple[int, ...] = LEVELS, runs: int = 3,
                   log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """See the module docstring; the ``vs_float32`` section of the bench's JSON."""
    quant, plain = EngineOptions(quantization), EngineOptions()
    out: dict[str, Any] = {"quantization": quantization, "cpu": cpu_description(),
                           "many_rows_path": _path(), "requests_per_seat": REQUESTS_PER_SEAT,
                           "goal": GOAL, "levels": {}}
    for c in levels:
        wl = make_workload(REQUESTS_PER_SEAT * c, seed=1000 + c, vocab=shape.vocab)
        rounds: list[dict[str, Any]] = []
        for i in range(runs):
            order = [(quantization, quant), ("float32", plain)]
            if i % 2:
                order.reverse()
            got: dict[str, dict[str, Any]] = {}
            for name, opts in order:
                log(f"  {c} concurrent, round {i + 1}/{runs}: {name} weights ...")
                got[name] = _serve(model_dir, wl, shape, opts, c)
            rounds.append({"quantized": got[quantization], "float32": got["float32"],
                           "ratio": ratio(got[quantization]["tokens_per_s"],
                                          got["float32"]["tokens_per_s"])})
        ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
        med = statistics.median(ratios) if ratios else None
        out["levels"][str(c)] = {"requests": len(wl.prompts),
                                 "output_tokens": wl.num_output_tokens,
                                 "ratio_median": med, "ratio_worst": min(ratios, default=None),
                                 "rounds": rounds}
        log(f"  {c} concurrent: {quantization} / float32 = {med} (median of {len(ratios)})")
    meds = {c: v["ratio_median"] for c, v in out["levels"].items()}
    out["passed"] = all(m is not None and m >= GOAL["every_level"] for m in meds.values()) and (
        "1" not in meds or (meds["1"] or 0) >= GOAL["one_stream"])
    return out
