"""`vconsole bench whatif`: how far the what-if's predictions are from the real engine.

For each workload:

1. **Record.** An engine is started with the workload's config and ``--request-trace``, and the
   workload runs against it for ``seconds``, then drains (every request finishes): the trace.
   - ``demo``: the demo's engine and load (`vconsole.tools.demo`: smollm2 when installed, its
     byte-budget pool, 12 seats, 128-token steps, hybrid; bursts, quiet spells, long prompts,
     shared prefixes, three priorities) through the engine's client.
   - ``serve``: `vconsole serve --model tiny` and a Poisson load over HTTP (prompts 16-384
     tokens, a third sharing a 64-token prefix, outputs 16-128, two priorities).
2. **Predict** with `vconsole.whatif.predict.whatif` for held-out variants the trace never ran:
   ``max_num_seqs`` halved and doubled, ``max_num_batched_tokens`` halved, the pool halved, the
   policy changed.
3. **Validate**: the baseline and each variant run on a real engine, the trace replayed on its
   timestamps (`vconsole.tools.whatif_validate`); the error of each figure is prediction over
   real minus one. The baseline is replayed a second time: how far two runs of the same real
   engine on the same trace differ (``real_spread``) is the floor under any prediction's error.
4. **Block sizes** 8-128 at the pool's bytes, predicted: fragmentation and preemptions (the
   KV compression issue's block-size question).
5. **Speed**: the trace tiled to `SPEED_MINUTES` minutes, simulated once; ``speedup`` is trace
   seconds over simulation seconds (one core: the simulation is single-threaded Python).

``held-out`` (`vconsole.tools.bench.whatif_heldout`): seats to a fifth, the pool halved and
quartered, and overload, on a workload kept apart from the tuning traces, predicted with and
without a calibration and each validated by replay.

Goals (the issue's): medians (output tok/s, TTFT p50, ITL p50) within 5%, p99s and preemption
counts within 10%, and 10 minutes of trace simulated in 10 s or less.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.worker.gguf_model import smollm2_available
from vconsole.telemetry.request_trace import Trace, read_trace
from vconsole.tools.demo import DEMO_ENGINE_DEFAULTS, DEMO_RATE, REAL_ENGINE_DEFAULTS, REAL_RATE
from vconsole.tools.loadgen import LoadSpec, demo_rate, demo_spec, run_load
from vconsole.tools.whatif_validate import run_real, validate
from vconsole.whatif.predict import Baseline, errors, observed, predicted, whatif

MEDIANS = ("output_tok_s", "ttft_p50_s", "itl_p50_s")
TAILS = ("ttft_p99_s", "itl_p99_s", "preemptions")
GOAL_MEDIAN, GOAL_TAIL = 0.05, 0.10
SPEED_MINUTES = 10.0
GOAL_SPEED_S = 10.0
SERVE_ENGINE = {"model": "tiny", "num_kv_blocks": 96, "block_size": 16, "max_num_seqs": 16,
                "max_num_batched_tokens": 256, "policy": "fcfs"}
SERVE_RATE = 10.0          # ~60% of the tiny engine's pace on 1 thread: queues, not a backlog

Log = Callable[[str], None] | None


def _args(config: dict[str, Any]) -> list[str]:
    return [a for k, v in config.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def record_demo(seconds: float, path: Path, log: Log) -> dict[str, Any]:
    real = smollm2_available()
    config = {"model": "smollm2", **REAL_ENGINE_DEFAULTS} if real else \
        {"model": "tiny", **DEMO_ENGINE_DEFAULTS}
    rate = REAL_RATE if real else DEMO_RATE
    num = max(20, int(seconds * rate))
    spec = demo_spec(prompts="auto")
    spec.num = num
    if log:
        log(f"demo: recording {num} requests of the demo's load on {config['model']}")
    with EngineProcess([*_args(config), "--request-trace", str(path)]).start(
            timeout_s=300) as engine:

        async def go() -> None:
            async with AsyncEngineClient(engine.endpoints["input"], engine.endpoints["output"],
                                         timeout_s=60.0) as client:
                await run_load(client, spec, rate_fn=demo_rate(rate))

        asyncio.run(go())
    return config


def record_serve(seconds: float, path: Path, log: Log) -> dict[str, Any]:
    from vconsole.tools.http_load import HttpLoadClient

    num = int(seconds * SERVE_RATE)
    spec = LoadSpec(num=num, rate=SERVE_RATE, prompt_len=(16, 384), output_len=(16, 128),
                    priority_mix=[(0, 1.0), (1, 3.0)], shared_prefix_share=0.33,
                    shared_prefix_len=64, seed=1)
    if log:
        log(f"serve: recording {num} requests over HTTP on vconsole serve --model tiny")
    with socket.socket() as s:          # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [sys.executable, "-m", "vconsole", "serve", *_args(SERVE_ENGINE), "--port", str(port),
           "--request-trace", str(path)]
    with tempfile.TemporaryFile() as err:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while not _serving(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    err.seek(0)
                    raise RuntimeError("vconsole serve did not start: "
                                       + err.read().decode(errors="replace")[-400:])
                time.sleep(0.3)

            async def go() -> None:
                async with HttpLoadClient(url) as client:
                    await run_load(client, spec)     # type: ignore[arg-type]

            asyncio.run(go())
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return SERVE_ENGINE


def _serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def held_out(config: dict[str, Any], trace: Trace) -> list[dict[str, Any]]:
    """The variants the trace never ran (the issue's list)."""
    seqs = int(config["max_num_seqs"])
    tokens = int(config["max_num_batched_tokens"])
    blocks = int(trace.header.num_kv_blocks or 0)
    policy = str(config["policy"])
    return [{"max_num_seqs": max(1, seqs // 2)}, {"max_num_seqs": seqs * 2},
            {"max_num_batched_tokens": max(16, tokens // 2)},
            {"num_kv_blocks": max(1, blocks // 2)},
            {"policy": "fcfs" if policy != "fcfs" else "priority"}]


def tiled(trace: Trace, minutes: float) -> Trace:
    """The trace's requests repeated back to back until ``minutes`` of arrivals."""
    out = copy.copy(trace)
    span = max(r.arrival for r in trace.requests) - min(r.arrival for r in trace.requests)
    span = max(span, 1.0) + 1.0
    reps = max(1, int(minutes * 60 / span) + 1)
    out.requests = [copy.copy(r) for _ in range(reps) for r in trace.requests]
    for i, r in enumerate(out.requests):
        r.arrival += (i // len(trace.requests)) * span
    out.requests.sort(key=lambda r: r.arrival)
    out.requests = [r for r in out.requests if r.arrival <= minutes * 60]
    return out


def speed(trace: Trace, minutes: float = SPEED_MINUTES) -> dict[str, Any]:
    long = tiled(trace, minutes)
    base = Baseline(long, costs=trace)
    t0 = time.process_time()
    result = base.run({})
    cpu = time.process_time() - t0
    last = max(r.finish for r in result.requests)
    return {"trace_s": round(last, 1), "requests": len(long.requests),
            "steps": len(result.steps), "sim_cpu_s": round(cpu, 3),
            "speedup": round(last / cpu, 1) if cpu else None}


BLOCK_SIZES = (8, 16, 32, 64, 128)


def block_sizes(trace: Trace) -> list[dict[str, Any]]:
    """The pool's bytes at each block size (predicted only): blocks, fragmentation (mean over
    busy steps of 1 - tokens stored / slots of the blocks in use), preemptions, TTFT p99."""
    base = Baseline(trace)
    rows = []
    for B in BLOCK_SIZES:
        try:
            p = predicted(base.run({"block_size": B}))
        except ValueError as e:            # a pool of less than one block
            rows.append({"block_size": B, "error": str(e)})
            continue
        rows.append({"block_size": B, "num_kv_blocks": p["num_kv_blocks"],
                     "fragmentation_mean": p["fragmentation_mean"],
                     "preemptions": p["preemptions"], "ttft_p99_s": p["ttft_p99_s"],
                     "output_tok_s": p["output_tok_s"], "rejected": p["rejected"]})
    return rows


def score(report: dict[str, Any], spread: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every validated figure's error, and the goals' verdict over the held-out variants.
    With ``spread`` (two real runs of the baseline: how far apart they were, per figure):
    ``within_real_spread``, the share of (run, figure) errors no larger than the goal or the
    real engine's own spread on that figure, whichever is larger: an error below the spread is
    as close as the real engine comes to itself."""
    rows = []
    for entry in [report["baseline"], *report["variants"]]:
        err = entry.get("validation_error") or {}
        rows.append({"set": entry.get("set", {}), **{k: err.get(k) for k in MEDIANS + TAILS}})
    worst_med = max((abs(r[k]) for r in rows for k in MEDIANS if r[k] is not None), default=None)
    worst_tail = max((abs(r[k]) for r in rows for k in TAILS if r[k] is not None), default=None)
    med = [abs(r[k]) for r in rows for k in MEDIANS if r[k] is not None]
    judged = [(k, abs(r[k])) for r in rows for k in MEDIANS + TAILS if r[k] is not None]
    floor = {k: max(GOAL_MEDIAN if k in MEDIANS else GOAL_TAIL,
                    abs((spread or {}).get(k) or 0.0)) for k in MEDIANS + TAILS}
    within = sum(1 for k, e in judged if e <= floor[k])
    return {"errors": rows, "worst_median_error": worst_med, "worst_tail_error": worst_tail,
            "within_real_spread": round(within / len(judged), 3) if judged else None,
            "bound_per_figure": {k: round(v, 4) for k, v in floor.items()},
            "mean_median_error": round(statistics.fmean(med), 4) if med else None,
            "medians_within_goal": worst_med is not None and worst_med <= GOAL_MEDIAN,
            "tails_within_goal": worst_tail is not None and worst_tail <= GOAL_TAIL}


def whatif_bench(seconds: float = 90.0, workloads: tuple[str, ...] = ("demo", "serve"),
                 log: Log = None, trace_dir: str | None = None,
                 seed: int | None = None) -> dict[str, Any]:
    """See the module docstring; ``trace_dir``: keep the recorded traces there (default: a
    temporary folder, removed); ``seed``: the held-out workloads' seed (default their own)."""
    # Every engine of the run (recorded and validating) gets the same torch threads, one core
    # short of the machine's: the load client needs one, and OpenMP threads spin-waiting
    # beside it slow steps at random (a step-time model measures the engine, not that).
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    out: dict[str, Any] = {"bench": "whatif", "seconds": seconds, "torch_threads": int(threads),
                           "goals": {
        "median_error": GOAL_MEDIAN, "tail_error": GOAL_TAIL,
        "sim_s_per_10_min": GOAL_SPEED_S}, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="vconsole-bench-whatif-") as tmp_dir:
        tmp = trace_dir or tmp_dir
        for name in workloads:
            if name.startswith("held-out"):
                from vconsole.tools.bench.whatif_heldout import heldout_bench

                model = name.removeprefix("held-out").removeprefix("-") or "tiny"
                out["workloads"][name] = heldout_bench(seconds, Path(tmp), log, model=model,
                                                       seed=seed)
                continue
            path = Path(tmp) / f"{name}.jsonl"
            config = (record_demo if name == "demo" else record_serve)(seconds, path, log)
            trace = read_trace(path)
            report = whatif(trace, held_out(config, trace))
            validate(trace, report, progress=log)
            if log:
                log(f"{name}: the baseline replayed once more (the real engine's own spread)")
            again = observed(run_real(trace, report["baseline"]["config"]))
            spread = errors(report["baseline"]["validated"], again)
            out["workloads"][name] = {"config": config, "report": report,
                                      "score": score(report, spread),
                                      "real_spread": {"second_run": again, "difference": spread},
                                      "speed": speed(trace), "block_sizes": block_sizes(trace)}
            if log:
                s = out["workloads"][name]["score"]
                log(f"{name}: worst median error {s['worst_median_error']}, worst tail error "
                    f"{s['worst_tail_error']}")
    w = [x for n, x in out["workloads"].items() if not n.startswith("held-out")]
    out["passed"] = all(x["score"]["medians_within_goal"] and x["score"]["tails_within_goal"]
                        and (x["speed"]["sim_cpu_s"] * 600 / max(x["speed"]["trace_s"], 1)
                             <= GOAL_SPEED_S) for x in w) and all(
        x["passed"] for n, x in out["workloads"].items() if n.startswith("held-out"))
    return out
