"""`vconsole bench NAME`: run a benchmark and print its JSON."""

from __future__ import annotations

import argparse
import json
import sys

from vconsole.commands import fail


def main(args: argparse.Namespace) -> int:
    # The built-in names are the worker's (standard library only there), read here rather than
    # in the parser so `vconsole --help` imports no engine package.
    from vconsole.engine.worker.gguf_model import BUILT_IN_MODELS

    if args.model_config not in BUILT_IN_MODELS:
        return fail("bench", f"--model-config: unknown built-in model {args.model_config!r} "
                             f"(choose from {', '.join(BUILT_IN_MODELS)})", 2)
    log = None if args.json else (lambda m: print(m, file=sys.stderr))
    if args.name == "scheduler":
        from vconsole.tools.bench.scheduler import scheduler_bench

        out = scheduler_bench(args.sizes, args.steps, log)
    elif args.name == "kvmap":
        from vconsole.tools.bench.kvmap import kvmap_bench

        out = kvmap_bench(args.num_blocks, args.rounds or 30, log)
    elif args.name == "telemetry":
        from vconsole.tools.bench.telemetry import telemetry_bench

        out = telemetry_bench(args.num_requests or 20_000, args.rounds or 200,
                              args.seconds or 0.2, log, runs=args.runs)
    elif args.name == "console":
        from vconsole.tools.bench.console import console_bench

        out = console_bench(args.num_requests or 10_000, args.seconds or 4.0, log)
    elif args.name == "soak":
        from vconsole.tools.bench.soak import soak_bench

        out = soak_bench(args.minutes, data_parallel_size=args.data_parallel_size or 1,
                         rate=args.rate, log=log,
                         data_parallel_backend=args.data_parallel_backend)
        print(json.dumps(out, indent=None if args.json else 2))
        return 0 if out["passed"] else 1
    elif args.name == "serve":
        from vconsole.tools.bench.serve import RequestsFailed, serve_bench

        try:
            out = serve_bench(args.concurrency, args.rounds or 2, model=args.model_config,
                              compare_transformers=not args.no_transformers, log=log)
        except RequestsFailed as e:     # no figures from a run whose requests failed
            print(f"vconsole bench serve: {e}", file=sys.stderr)
            return 1
    elif args.name == "quality":
        from vconsole.tools.bench.quality import quality_bench

        try:
            out = quality_bench(args.model, args.windows, args.window_tokens, args.chat_prompts,
                                args.new_tokens, kv_cache_dtype=args.kv_cache_dtype,
                                quantization=args.quantization, log=log)
        except ValueError as e:         # a model that cannot load, windows the text lacks
            return fail("bench", str(e), 2)
        print(json.dumps(out, indent=None if args.json else 2))
        return 0 if out["passed"] else 1
    elif args.name == "kv-ideas":
        from vconsole.tools.bench.kv_ideas import kv_ideas_bench

        out = kv_ideas_bench(log=log, num_requests=args.num_requests)
    elif args.name == "kv-grouping":
        from vconsole.tools.bench.kv_grouping import kv_grouping_bench

        out = kv_grouping_bench(args.model, min(args.windows, 16), args.window_tokens, log=log)
    elif args.name == "whatif":
        from vconsole.tools.bench.whatif import whatif_bench

        out = whatif_bench(args.seconds or 90.0, log=log)
        print(json.dumps(out, indent=None if args.json else 2))
        return 0 if out["passed"] else 1
    elif args.name == "dp":
        from vconsole.tools.bench.dp import dp_bench

        out = dp_bench(args.num_requests or 32, args.rounds or 3, log=log,
                       backend=args.data_parallel_backend)
    elif args.name == "structured":
        from vconsole.tools.bench.structured import structured_bench

        try:
            out = structured_bench(args.model, args.num_requests or 64,
                                   args.concurrency or [1, 32], args.rounds or 1, log=log)
        except ValueError as e:         # a model that cannot load
            return fail("bench", str(e), 2)
    else:  # torch and transformers are imported only for the benchmark that needs them
        from vconsole.tools.bench.throughput import throughput

        out = throughput(args)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
