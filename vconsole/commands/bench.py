"""`vconsole bench NAME`: run a benchmark and print its JSON, one handler per benchmark (their
parsers: `vconsole.commands.bench_flags`). torch, transformers and the engine are imported only
by the benchmark that needs them."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.commands import fail


def throughput(args: argparse.Namespace) -> int:
    if (code := _unknown_model_config(args)) is not None:
        return code
    from vconsole.tools.bench.throughput import throughput as throughput_bench

    return _report(args, throughput_bench(args))


def build_llama_server(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.llama_server_build import main

    return main([f"--jobs={args.jobs}", *(["--rebuild"] if args.rebuild else [])])


def scheduler(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.scheduler import scheduler_bench

    return _report(args, scheduler_bench(args.sizes, args.steps, _log(args)))


def kvmap(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.kvmap import kvmap_bench

    return _report(args, kvmap_bench(args.num_blocks, args.rounds or 30, _log(args)))


def telemetry(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.telemetry import telemetry_bench

    extra = {k: True for k, on in (("kv_cache_metrics", args.kv_cache_metrics),
                                   ("enable_mfu_metrics", args.enable_mfu_metrics),
                                   ("collect_detailed_traces", args.collect_detailed_traces))
             if on}
    return _report(args, telemetry_bench(args.num_requests or 20_000, args.rounds or 200,
                                         args.seconds or 0.2, _log(args), runs=args.runs,
                                         extra=extra))


def console(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.console import console_bench

    return _report(args, console_bench(args.num_requests or 10_000, args.seconds or 4.0,
                                       _log(args)))


def soak(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.soak import soak_bench

    out = soak_bench(args.minutes, data_parallel_size=args.data_parallel_size or 1,
                     rate=args.rate, log=_log(args),
                     data_parallel_backend=args.data_parallel_backend)
    return _report(args, out, passed=out["passed"])


def serve(args: argparse.Namespace) -> int:
    if (code := _unknown_model_config(args)) is not None:
        return code
    from vconsole.tools.bench.serve import RequestsFailed, serve_bench

    try:
        out = serve_bench(args.concurrency, args.rounds or 2, model=args.model_config,
                          compare_transformers=not args.no_transformers, log=_log(args))
    except RequestsFailed as e:         # no figures from a run whose requests failed
        print(f"vconsole bench serve: {e}", file=sys.stderr)
        return 1
    return _report(args, out)


def quality(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.quality import quality_bench

    try:
        out = quality_bench(args.model, args.windows, args.window_tokens, args.chat_prompts,
                            args.new_tokens, max_num_batched_tokens=args.chunk,
                            kv_cache_dtype=args.kv_cache_dtype,
                            quantization=args.quantization, log=_log(args), text=args.text)
    except ValueError as e:             # a model that cannot load, windows the text lacks
        return fail("bench", str(e), 2)
    return _report(args, out, passed=out["passed"])


def kv_ideas(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.kv_ideas import kv_ideas_bench

    return _report(args, kv_ideas_bench(log=_log(args), num_requests=args.num_requests))


def kv_grouping(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.kv_grouping import kv_grouping_bench

    try:
        out = kv_grouping_bench(args.model, min(args.windows, 16), args.window_tokens,
                                log=_log(args), text=args.text)
    except ValueError as e:             # windows the text lacks
        return fail("bench", str(e), 2)
    return _report(args, out)


def whatif(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.whatif import whatif_bench

    names = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    known = ("demo", "serve", "held-out", "held-out-smollm2")
    unknown = [w for w in names if w not in known]
    if unknown:
        print(f"vconsole bench whatif: unknown workload {', '.join(unknown)} "
              f"({', '.join(known)})", file=sys.stderr)
        return 2
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    out = whatif_bench(args.seconds or 90.0, workloads=names, log=_log(args),
                       trace_dir=args.trace_dir, seed=args.seed)
    return _report(args, out, passed=out["passed"])


def dp(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.dp import dp_bench

    return _report(args, dp_bench(args.num_requests or 32, args.rounds or 3, log=_log(args),
                                  backend=args.data_parallel_backend))


def structured(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.structured import structured_bench

    try:
        out = structured_bench(args.model, args.num_requests or 64, args.concurrency or [1, 32],
                               args.rounds or 1, log=_log(args))
    except ValueError as e:             # a model that cannot load
        return fail("bench", str(e), 2)
    return _report(args, out)


def spec(args: argparse.Namespace) -> int:
    from vconsole.shared.speculative import parse_speculative_config
    from vconsole.tools.bench.spec import spec_bench

    config = None
    if args.speculative_config is not None:
        try:
            parsed = parse_speculative_config(args.speculative_config)
        except ValueError as e:
            return fail("bench", f"--speculative-config: {e}", 2)
        config = json.loads(parsed.to_json()) if parsed is not None else None
    try:
        out = spec_bench(args.model, spec=config, max_tokens=args.max_tokens,
                         num_chat=args.num_chat, quantization=args.quantization,
                         log=_log(args))
    except ValueError as e:             # a model that cannot load
        return fail("bench", str(e), 2)
    return _report(args, out)


def fleet(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.fleet import fleet_bench

    if args.prometheus:
        from vconsole.tools.bench.fleet_prometheus import prometheus_fleet_bench

        return _report(args, prometheus_fleet_bench(
            args.targets, args.engines, args.seconds or 60.0, args.base_port,
            log=_log(args) or (lambda _m: None)))
    out = fleet_bench(args.targets, args.engines, args.seconds or 20.0, args.base_port,
                      log=_log(args) or (lambda _m: None))
    return _report(args, out)


def metrics(args: argparse.Namespace) -> int:
    from vconsole.tools.bench.metrics_scrape import metrics_bench

    out = metrics_bench(args.waiting, args.scrapes, args.pairs, args.seconds or 5.0,
                        log=_log(args) or (lambda _m: None))
    return _report(args, out)


def _log(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines to stderr, none with --json."""
    return None if args.json else (lambda m: print(m, file=sys.stderr))


def _report(args: argparse.Namespace, out: dict[str, Any], passed: bool = True) -> int:
    """Print the benchmark's JSON; exit 1 for a benchmark with a goal it did not pass."""
    print(json.dumps(out, indent=None if args.json else 2))
    return 0 if passed else 1


def _unknown_model_config(args: argparse.Namespace) -> int | None:
    # The built-in names are the worker's (standard library only there), read here rather than
    # in the parser so `vconsole --help` imports no engine package.
    from vconsole.engine.worker.gguf_model import BUILT_IN_MODELS

    if args.model_config in BUILT_IN_MODELS:
        return None
    return fail("bench", f"--model-config: unknown built-in model {args.model_config!r} "
                         f"(choose from {', '.join(BUILT_IN_MODELS)})", 2)
