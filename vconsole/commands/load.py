"""`vconsole load`: drive a running engine with generated requests and print the summary.

Two kinds of workload, never mixed: a synthetic one (`WORKLOAD_FLAGS`: count, rate, lengths,
priorities, seed) or a recorded trace replayed (``--trace FILE [--speed X]``:
`vconsole.tools.trace_replay`); a flag of the one given with the other is refused, not ignored.

Exit status: 0 when every request sent completed (or was aborted by Ctrl-C), 1 when any failed
or the engine was lost (the summary names each failure's kind), 2 for bad arguments and for a
trace that cannot be replayed there (unreadable, empty or cut short, from another model, nothing
left to replay): then nothing is sent."""

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
from vconsole.telemetry.request_trace import Trace, TraceError, read_trace
from vconsole.tools.load_summary import LoadRun, format_summary
from vconsole.tools.loadgen import LoadSpec, parse_mix, parse_range, run_load, run_timed
from vconsole.tools.trace_replay import ReplayPlan, check_speed, format_report, plan_replay

# The flags that define a synthetic workload (attribute -> (flag, default)): the parser leaves
# them None, so that one given beside --trace can be told from its default.
WORKLOAD_FLAGS: dict[str, tuple[str, Any]] = {
    "num": ("--num", 100), "rate": ("--rate", None), "concurrency": ("--concurrency", None),
    "prompt_len": ("--prompt-len", "16:128"), "output_len": ("--output-len", "16:64"),
    "priority_mix": ("--priority-mix", "0:1"), "prompts": ("--prompts", "tokens"),
    "seed": ("--seed", 0),
}


def _flag(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return WORKLOAD_FLAGS[name][1] if value is None else value


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    num = _flag(args, "num")
    if num < 1:
        raise ValueError("--num must be >= 1")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return LoadSpec(num=num, rate=args.rate, concurrency=args.concurrency,
                    prompt_len=parse_range(_flag(args, "prompt_len")),
                    output_len=parse_range(_flag(args, "output_len")),
                    priority_mix=parse_mix(_flag(args, "priority_mix")), seed=_flag(args, "seed"),
                    prompts=_flag(args, "prompts"))


def check_trace_args(args: argparse.Namespace) -> None:
    """--trace and the synthetic workload's flags exclude each other; --speed needs --trace."""
    if getattr(args, "trace", None) is None:
        if getattr(args, "speed", None) is not None:
            raise ValueError("--speed applies to a replayed trace: give --trace FILE")
        return
    given = [flag for name, (flag, _) in WORKLOAD_FLAGS.items()
             if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--trace replays the trace's own arrivals, lengths and priorities: "
                         f"it cannot be combined with {', '.join(given)} (drop "
                         f"{'them' if len(given) > 1 else 'it'}, or drop --trace)")
    if args.speed is not None:
        check_speed(args.speed)


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
    trace: Trace | None = None
    try:
        check_trace_args(args)
        spec = None if args.trace else spec_from_args(args)
        curve = client_curve(args)
        if args.trace:
            trace = read_trace(args.trace)      # refused here, before any connection
    except ValueError as e:     # CurveKeyError and TraceError too
        return fail("load", e, 2)
    progress = None if args.json or trace is not None else Progress(_flag(args, "num"))
    stop = threading.Event()
    plan: ReplayPlan | None = None

    async def go() -> LoadRun:
        nonlocal plan, progress
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
            if trace is None:
                assert spec is not None
                return await run_load(client, spec, stop=stop,
                                      on_progress=progress.show if progress else None)
            plan = plan_replay(trace, client.engine_info, speed=args.speed or 1.0,
                               file=args.trace)    # refused here, before anything is sent
            if not args.json:
                progress = Progress(len(plan.requests))
            return await run_timed(client, plan.requests, stop=stop,
                                   on_progress=progress.show if progress else None)

    try:
        run = asyncio.run(go())
    except TraceError as e:     # another model, nothing to replay: nothing was sent
        return fail("load", e, 2)
    except (TimeoutError, OSError, ValueError) as e:   # OSError: HttpError, no server there
        where = f"{args.api_url}: " if args.api_url else ""
        return fail("load", f"{where}{e}")
    if progress:
        progress.end()
    summary: dict[str, Any] = run.summary()
    if plan is not None:
        summary["trace"] = plan.report(run)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        if plan is not None:
            print(format_report(summary["trace"]))
    planned = len(plan.requests) if plan is not None else _flag(args, "num")
    code, why = outcome(run, summary, planned, interrupted=stop.is_set())
    if why:
        print(f"vconsole load: {why}", file=sys.stderr)
    return code
