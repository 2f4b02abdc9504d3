"""`vconsole top`: a telemetry snapshot (or a line a second) for scripts."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import zmq

from vconsole.commands import fail
from vconsole.commands.attach_targets import has_targets
from vconsole.commands.curve_args import client_curve
from vconsole.console.sources.vllm import ScrapeError
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL, DEFAULT_TELEMETRY
from vconsole.telemetry.printable import printable
from vconsole.tools.top import (
    VllmWatcher,
    Watcher,
    format_line,
    format_ranks_line,
    snapshot_once,
    snapshot_vllm,
)


def main(args: argparse.Namespace) -> int:
    if has_targets(args):
        from vconsole.commands.top_fleet import main_fleet

        return main_fleet(args)
    if getattr(args, "vllm", None):
        return _main_vllm(args)
    telemetry = getattr(args, "telemetry", None) or DEFAULT_TELEMETRY
    control = getattr(args, "control", None) or DEFAULT_CONTROL
    timeout = float(getattr(args, "timeout", 10.0) or 10.0)
    as_json = bool(getattr(args, "json", False))
    try:
        curve = client_curve(args)
    except CurveKeyError as e:
        return fail("top", e, 2)
    if getattr(args, "once", False):
        snap, missing = snapshot_once(telemetry, control, timeout, curve=curve)
        if missing:
            print(f"vconsole top: no complete telemetry from {telemetry} within {timeout:g} s "
                  f"(never saw: {', '.join(missing)}); is the engine running?", file=sys.stderr)
            return 1
        _print_snapshot(snap, as_json)
        return 0
    w = Watcher(telemetry, zmq.Context.instance(), curve)
    try:
        while True:
            w.pump(1.0)
            if as_json:
                print(strict_json(w.snapshot()), flush=True)
            elif w.world_size() > 1:
                print(format_ranks_line(w), flush=True)
            else:
                print(format_line({t: m.payload for t, m in w.latest.items()}), flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        w.close()


def _main_vllm(args: argparse.Namespace) -> int:
    """``top --vllm URL``: the same output from a vLLM server's ``/metrics``."""
    as_json = bool(getattr(args, "json", False))
    try:
        if getattr(args, "once", False):
            snap = snapshot_vllm(args.vllm)
            _print_snapshot(snap, as_json)
            return 0
        w = VllmWatcher(args.vllm)
        while True:
            try:
                w.pump()
                _print_snapshot(w.snapshot(), as_json, flush=True)
            except ScrapeError as e:     # a restart or a slow scrape: say so, keep watching
                print(printable(f"vconsole top: {e}"), file=sys.stderr, flush=True)
            time.sleep(w.scraper.translator.interval_s)
    except ScrapeError as e:
        return fail("top", e)
    except ValueError as e:
        return fail("top", f"--vllm: {e}", 2)
    except KeyboardInterrupt:
        return 0


def strict_json(value: Any) -> str:
    """JSON that every parser reads: a histogram's ``+Inf`` bound (and any other non-finite
    float) is written as the string ``"+Inf"`` / ``"-Inf"`` / ``"NaN"``, as Prometheus's own JSON
    API writes ``le``; Python's ``Infinity`` is not JSON."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(value), default=str, allow_nan=False)


def _print_snapshot(snap: dict[str, Any], as_json: bool, flush: bool = False) -> None:
    if as_json:
        print(strict_json(snap), flush=flush)
    elif "ranks" in snap:       # several engines: one line per rank
        for rank, bodies in sorted(snap["ranks"].items(), key=lambda kv: int(kv[0])):
            print(f"rank {rank}  {format_line(bodies)}", flush=flush)
    else:
        print(format_line(snap), flush=flush)
