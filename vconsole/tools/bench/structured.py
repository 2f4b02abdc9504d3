"""`vconsole bench structured`: requests under a JSON schema against the same requests
unconstrained, on a real model (``smollm2`` by default), as JSON.

**Workload.** ``--num-requests`` (64) chat prompts that ask for an object, cycling six schemas
(`SCHEMAS`: nested objects, arrays of objects, enums, required fields, string patterns; every
string, array and number bounded), the schema in the system prompt as a deployment would
write it; greedy, ``max_tokens`` 256 (above any schema's longest instance). Closed loop at each
``--concurrency`` level (1 and 32): that many requests in flight, a finished one letting the
next in.

**The two sides.** Constrained: each request carries ``structured = {"kind": "json",
"value": schema}`` (no ``ignore_eos``: the engine refuses it with a grammar); it stops where
the grammar ends. Unconstrained: the same prompts with ``max_tokens`` set to the length of the
constrained output of the same request, and ``ignore_eos``, so both sides compute exactly the
same tokens (the engine runs without its prefix cache, else the second side would find the
first side's prompts cached) and the ratio of their output tok/s is the cost of the grammar alone (a small
model left free talks to max_tokens, and a ratio over different lengths would measure the
lengths). The first round runs constrained first (its lengths are the twins'); with
``--rounds`` > 1 later rounds alternate the order, and tok/s is the rounds' median.

**Figures per level.** ``validity``: each constrained output through ``json.loads`` and
``jsonschema.validate``, the count of failures by kind and an example of each;
``constrained`` / ``unconstrained``: output tokens, elapsed, tok/s, finish reasons, the
engine's own step records of the run (its request trace: all steps and their summed time
``busy_s``, and the decode-only steps
at the run's steady batch, at least 3/4 of its widest, whose median is one step's cost) and
``structured_share_of_step``: the ``structured`` phase (bitmask filled and applied, matchers
advanced) over the busy time of the run's steps, from the engine's ``step`` telemetry;
``ratio`` (constrained tok/s over unconstrained: goal ≥ 0.95 at 32), ``steady_step_ratio``
(the steady steps' medians: the same question asked of the steps); ``engine_compiles``: the
engine's compile counters over the constrained run (compiles, cache hits, errors, mean ms).

**Compile time per schema** (``compile``): the engine's own `GrammarCompiler` in this process
after the engine stopped: cold (a fresh compiler, tokenizer built: what a new spec costs) and
cached (the same spec again: the cache's future and the matcher copy a request gets), and the
probe's schema below.

**Compiles beside the busy loop** (``compile_probe``): with ``top - 1`` rows decoding
(unconstrained, ``ignore_eos``), probe requests are sent one at a time, `GAP_STEPS` background
steps apart, each under a schema the engine has never seen: ``typical`` (6; 2 when the workload
is under 32 requests), one of the workload's schemas with an extra optional property named
after the probe (`typical_schema`: a compile of about a millisecond), then ``heavy`` (half as
many), a 300-property schema (`heavy_schema`: tens of ms). From the request trace, the
background's decode-only steps that ran while a probe's grammar compiled (from its submit to
the step that admitted it) are set against the window's steps that no probe touched, at the
same batch: their medians' ratio, and how many compile-window steps were longer than the
others' p90 and than their max (goal: no typical compile's step longer than the max).
``first_masks``: the steps after a probe's admission, where its first masks run on the busy
loop.

**Paired steps** (``paired_steps``, at the top concurrency, after the engine stopped): the
same workload on two cores in this process stepped in turn, constrained and unconstrained, the
same batch at every step (`structured_paired`): the grammar's cost per step with the machine's
drift cancelled, and the throughput ratio it implies (goal ≥ 0.95).

The machine's load average at the start and end is in the JSON: on shared cores the tok/s of
two runs swing by more than the goal's 5%, so read the steady step ratio, the structured
share and the paired steps beside the ratio.

One module per job: the schemas (`structured_schemas`), the closed-loop runs
(`structured_runs`), validity (`structured_validity`), the engine's step records
(`structured_steps`) and telemetry (`structured_phases`), the compile times
(`structured_compile`), the stall probe (`structured_probe`), the paired steps
(`structured_paired`); this one runs the bench and writes its report.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vconsole.tools.bench.structured_compile import compile_figures
from vconsole.tools.bench.structured_phases import COMPILE_COUNTERS, Phases
from vconsole.tools.bench.structured_probe import compile_probe, stall_figures
from vconsole.tools.bench.structured_runs import MAX_TOKENS, Job, run_figures, run_jobs, workload
from vconsole.tools.bench.structured_schemas import SCHEMAS, heavy_schema, typical_schema
from vconsole.tools.bench.structured_steps import in_window, read_steps, step_figures
from vconsole.tools.bench.structured_validity import validity

Log = Callable[[str], None] | None
SIDES = ("constrained", "unconstrained")


@dataclass
class _Levels:
    """What the runs at every concurrency level leave for the report, keyed by level."""

    windows: list[tuple[str, float, float]] = field(default_factory=list)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    valid: dict[str, dict[str, Any]] = field(default_factory=dict)
    compiles: dict[str, dict[str, float]] = field(default_factory=dict)
    shares: dict[str, dict[str, float | None]] = field(default_factory=dict)


def _run_level(endpoints: dict[str, str], tokenizer: Any, jobs: list[Job], c: int,
               rounds: int, max_tokens: int, phases: Phases, levels: _Levels,
               say: Callable[[str], None]) -> None:
    """Both sides at concurrency ``c`` for ``rounds`` rounds. The constrained run goes first
    in the first round: its output lengths are the unconstrained twins' (with ignore_eos), so
    both sides compute the same tokens; later rounds alternate."""
    key = str(c)
    caps = [max_tokens] * len(jobs)
    levels.runs[key] = {side: [] for side in SIDES}
    lengths: list[int] | None = None
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            label = f"{key}/{side}"
            before = phases.snapshot()
            phases.label = label
            w0 = time.time()
            if side == "constrained":
                done, elapsed = run_jobs(endpoints, jobs, c, constrained=True, max_tokens=caps)
            else:
                assert lengths is not None
                done, elapsed = run_jobs(endpoints, jobs, c, constrained=False,
                                         max_tokens=lengths, ignore_eos=True)
            levels.windows.append((label, w0, time.time()))
            time.sleep(1.2)       # the step telemetry of the run's last steps
            phases.label = None
            if side == "constrained" and lengths is None:
                lengths = [max(1, len(d.token_ids)) for d in done]
                levels.valid[key] = validity(tokenizer, jobs, done)
                after = phases.snapshot()
                levels.compiles[key] = {k: after.get(k, 0.0) - before.get(k, 0.0)
                                        for k in COMPILE_COUNTERS}
            levels.runs[key][side].append(run_figures(done, elapsed))
            say(f"concurrency {c} round {r + 1} {side}: "
                f"{levels.runs[key][side][-1]['tok_per_s']} tok/s")
    levels.shares[key] = {side: phases.share(f"{key}/{side}") for side in SIDES}


def _level_report(key: str, levels: _Levels, started: float,
                  steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's figures: validity, each side's (tok/s the rounds' median, its steps, the
    structured share), the ratios and the engine's compile counters."""
    level: dict[str, Any] = {"validity": levels.valid[key]}
    for side, rs in levels.runs[key].items():
        level[side] = {**rs[0], "tok_per_s": statistics.median(x["tok_per_s"] for x in rs),
                       "tok_per_s_rounds": [x["tok_per_s"] for x in rs]}
        side_steps = [s for name, w0, w1 in levels.windows if name == f"{key}/{side}"
                      for s in in_window(steps, started, w0, w1)]
        level[side]["steps"] = step_figures(side_steps)
        level[side]["structured_share_of_step"] = levels.shares[key][side]
    u, k = level["unconstrained"], level["constrained"]
    level["ratio"] = round(k["tok_per_s"] / u["tok_per_s"], 3) if u["tok_per_s"] else None
    us, ks = u["steps"].get("steady_step_ms_median"), k["steps"].get("steady_step_ms_median")
    level["steady_step_ratio"] = round(ks / us, 3) if us and ks else None
    counts = levels.compiles[key]
    n = counts.get("structured_compiles_total", 0.0)
    level["engine_compiles"] = {
        "compiles": int(n),
        "cache_hits": int(counts.get("structured_compile_cache_hits_total", 0)),
        "errors": int(counts.get("structured_compile_errors_total", 0)),
        "compile_ms_mean": round(counts["structured_compile_seconds_total"] / n * 1e3, 3)
        if n and "structured_compile_seconds_total" in counts else None}
    return level


def structured_bench(model: str = "smollm2", num_requests: int = 64,
                     concurrencies: list[int] | None = None, rounds: int = 1,
                     max_tokens: int = MAX_TOKENS, probes: int | None = None,
                     log: Log = None) -> dict[str, Any]:
    from vconsole.engine.launch.engine_process import EngineProcess
    from vconsole.tools.bench.structured_paired import paired_steps
    from vconsole.tools.prompts import load_renderer

    say = log or (lambda _m: None)
    concurrency = concurrencies or [1, 32]
    if probes is None:
        probes = 6 if num_requests >= 32 else 2
    work = Path(tempfile.mkdtemp(prefix="vconsole-bench-structured-"))
    trace_path = work / "trace.jsonl"
    levels = _Levels()
    load = [os.getloadavg()[0]]
    probe_marks: dict[str, list[tuple[float, float]]] = {}
    t_bg = t_end = 0.0
    say(f"starting an engine ({model}) ...")
    # No prefix cache: the side that runs second would find the first side's prompts cached.
    args = ["--model", model, "--max-num-seqs", str(max(64, *concurrency)), "--no-prefix-caching",
            "--request-trace", str(trace_path)]
    try:
        with EngineProcess(args).start(timeout_s=300) as engine:
            model_path = engine.ready["model_path"]
            renderer = load_renderer(model_path)
            jobs = workload(renderer, num_requests)
            phases = Phases(engine.endpoints["telemetry"])
            try:
                run_jobs(engine.endpoints, jobs[:2], 2, constrained=False,
                         max_tokens=[4] * 2)                         # warm-up
                for c in concurrency:
                    _run_level(engine.endpoints, renderer.tokenizer, jobs, c, rounds,
                               max_tokens, phases, levels, say)
                if probes:
                    rows = max(1, max(concurrency) - 1)
                    say(f"compile probe: {probes} + {max(1, probes // 2)} cold compiles "
                        f"beside {rows} decoding rows")
                    background = [jobs[i % len(jobs)] for i in range(rows)]
                    tag = int(time.time())
                    groups = {"typical": [typical_schema(tag + i) for i in range(probes)],
                              "heavy": [heavy_schema(tag + i)
                                        for i in range(max(1, probes // 2))]}
                    probe_marks, t_bg, t_end = compile_probe(
                        engine.endpoints, renderer, background, groups,
                        int(engine.ready.get("max_model_len") or 2048))
            finally:
                phases.close()
            load.append(os.getloadavg()[0])
        say("compile times in this process ...")
        compile_times = compile_figures(model_path)
        top_c = concurrency[-1]
        paired = paired_steps(model_path, jobs, top_c, say) if top_c > 1 else None
        started, steps = read_steps(trace_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_levels = {key: _level_report(key, levels, started, steps) for key in levels.runs}
    stalls = stall_figures(steps, started, probe_marks, t_bg, t_end) if probes else None
    top = str(top_c)
    return {
        "model": model, "num_requests": num_requests, "max_tokens": max_tokens,
        "rounds": rounds, "schemas": [c.name for c in SCHEMAS], "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "concurrency": out_levels,
        "valid_rate": min(v["validity"]["valid_rate"] for v in out_levels.values()),
        "ratio_at_top": out_levels[top]["ratio"],
        "steady_step_ratio_at_top": out_levels[top]["steady_step_ratio"],
        "paired_steps": paired,
        "compile": compile_times,
        "compile_probe": stalls,
        "goals": {"valid_rate": "== 1.0", "ratio_at_top": ">= 0.95",
                  "paired_steps.throughput_ratio": ">= 0.95",
                  "compile_probe.typical.while_compiling_over_other_max": "== 0"},
    }
