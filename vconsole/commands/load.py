"""`vconsole load`: drive a running engine with generated requests and print the summary."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
from typing import Any

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.engine.proc.async_client import AsyncEngineClient
from vconsole.tools.loadgen import (
    LoadRun,
    LoadSpec,
    format_summary,
    parse_mix,
    parse_range,
    run_load,
)


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    if args.num < 1:
        raise ValueError("--num must be >= 1")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return LoadSpec(num=args.num, rate=args.rate, concurrency=args.concurrency,
                    prompt_len=parse_range(args.prompt_len), output_len=parse_range(args.output_len),
                    priority_mix=parse_mix(args.priority_mix), seed=args.seed)


def main(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
        curve = client_curve(args)
    except ValueError as e:     # CurveKeyError too
        return fail("load", e, 2)
    tty = sys.stderr.isatty() and not args.json
    stop = threading.Event()

    def show(p: dict[str, Any]) -> None:
        sys.stderr.write(f"\r sent {p['sent']}/{spec.num}  done {p['done']}  in-flight "
                         f"{p['in_flight']}  {p['tok_per_s']:.0f} tok/s  {p['elapsed_s']:.1f} s ")
        sys.stderr.flush()

    async def go() -> LoadRun:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            import signal
            loop.add_signal_handler(signal.SIGINT, stop.set)
        client: Any
        if args.api_url:            # an OpenAI-compatible server (vconsole serve, vLLM)
            from vconsole.tools.http_load import HttpLoadClient
            client = HttpLoadClient(args.api_url, api_key=args.api_key, model=args.model)
        else:
            client = AsyncEngineClient(args.input, args.output, curve=curve,
                                       timeout_s=args.wait)
        async with client:
            return await run_load(client, spec, stop=stop, on_progress=show if tty else None)

    try:
        run = asyncio.run(go())
    except (TimeoutError, OSError, ValueError) as e:   # OSError: HttpError, no server there
        where = f"{args.api_url}: " if args.api_url else ""
        return fail("load", f"{where}{e}")
    if tty:
        sys.stderr.write("\n")
    summary = run.summary()
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if run.engine_lost is not None:
        print(f"vconsole load: stopped after {run.sent} of {spec.num} requests: {run.engine_lost}",
              file=sys.stderr)
        return 1
    return 0
