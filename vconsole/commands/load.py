"""`vconsole load`: drive a running engine with generated requests and print the summary.

Exit status: 0 when every request sent completed (or was aborted by Ctrl-C), 1 when any failed
or the engine was lost (the summary names each failure's kind), 2 for bad arguments."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
from typing import Any

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.tools.load_summary import LoadRun, format_summary
from vconsole.tools.loadgen import LoadSpec, parse_mix, parse_range, run_load


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    if args.num < 1:
        raise ValueError("--num must be >= 1")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return LoadSpec(num=args.num, rate=args.rate, concurrency=args.concurrency,
                    prompt_len=parse_range(args.prompt_len), output_len=parse_range(args.output_len),
                    priority_mix=parse_mix(args.priority_mix), seed=args.seed,
                    prompts=getattr(args, "prompts", "tokens"))


def in_terminal_foreground(stream: Any) -> bool:
    """Whether ``stream`` is a terminal this process may draw on: a terminal, and this process
    in its foreground process group. A job started with ``&`` from an interactive shell is in
    a background group: its progress would land on whatever the foreground program (the
    console) draws."""
    try:
        fd = stream.fileno()
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except (OSError, ValueError, AttributeError):   # no file descriptor, or no terminal
        return False


class Progress:
    """The one-line progress on stderr, drawn only while the process is in the terminal's
    foreground (checked at every update: a job moved with ``bg``/``fg`` follows)."""

    def __init__(self, num: int, stream: Any = None) -> None:
        self.num = num
        self.stream = stream or sys.stderr
        self.drawn = False

    def show(self, p: dict[str, Any]) -> None:
        if not in_terminal_foreground(self.stream):
            return
        self.stream.write(f"\r sent {p['sent']}/{self.num}  done {p['done']}  in-flight "
                          f"{p['in_flight']}  {p['tok_per_s']:.0f} tok/s  "
                          f"{p['elapsed_s']:.1f} s ")
        self.stream.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn and in_terminal_foreground(self.stream):
            self.stream.write("\n")


def outcome(run: LoadRun, summary: dict[str, Any], num: int,
            interrupted: bool = False) -> tuple[int, str | None]:
    """The exit status and the line for stderr: 1 when the engine was lost or any request
    failed, over the socket and over HTTP alike; a Ctrl-C with nothing failed is 0 and says
    where it stopped."""
    if run.engine_lost is not None:
        return 1, f"stopped after {run.sent} of {num} requests: {run.engine_lost}"
    if summary["failed"]:
        kinds = ", ".join(f"{k} {v}" for k, v in summary["errors"].items())
        return 1, f"{summary['failed']} of {summary['requests']} requests failed ({kinds})"
    if interrupted:
        return 0, (f"stopped by Ctrl-C after {run.sent} of {num} requests "
                   f"({summary['aborted']} in flight aborted)")
    return 0, None


def main(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
        curve = client_curve(args)
    except ValueError as e:     # CurveKeyError too
        return fail("load", e, 2)
    progress = None if args.json else Progress(args.num)
    stop = threading.Event()

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
            return await run_load(client, spec, stop=stop,
                                  on_progress=progress.show if progress else None)

    try:
        run = asyncio.run(go())
    except (TimeoutError, OSError, ValueError) as e:   # OSError: HttpError, no server there
        where = f"{args.api_url}: " if args.api_url else ""
        return fail("load", f"{where}{e}")
    if progress:
        progress.end()
    summary = run.summary()
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    code, why = outcome(run, summary, args.num, interrupted=stop.is_set())
    if why:
        print(f"vconsole load: {why}", file=sys.stderr)
    return code
