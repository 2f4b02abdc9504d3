"""`vconsole attach` and `vconsole replay`: start the console on live endpoints or a file."""

from __future__ import annotations

import argparse
from pathlib import Path

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL, DEFAULT_TELEMETRY


def main(args: argparse.Namespace) -> int:
    """Attach to a running engine (plus any extra telemetry endpoints, e.g. DP ranks)."""
    from vconsole.console.app import VConsoleApp

    if getattr(args, "vllm", None):
        return _attach_vllm(args)
    try:
        curve = client_curve(args)
    except CurveKeyError as e:
        return fail("attach", e, 2)
    endpoints = [getattr(args, "telemetry", None) or DEFAULT_TELEMETRY,
                 *(getattr(args, "extra_telemetry", None) or [])]
    control = getattr(args, "control", None) or DEFAULT_CONTROL
    # Without the engine's control key (same machine: found by the endpoint) it is read-only.
    app = VConsoleApp(telemetry_endpoints=endpoints, control_endpoint=control,
                      readonly=bool(getattr(args, "readonly", False)),
                      control_key_file=getattr(args, "control_key_file", None), curve=curve)
    app.run()
    return 0


def _attach_vllm(args: argparse.Namespace) -> int:
    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.vllm import VllmSource
    from vconsole.telemetry.kv_wire import offset_endpoint

    try:
        for ep in (getattr(args, "kv_events", None), getattr(args, "kv_events_replay", None)):
            if ep:
                offset_endpoint(ep, 1)   # rank r listens on port + r: it needs a port
        source = VllmSource(args.vllm, kv_events=getattr(args, "kv_events", None),
                            kv_events_replay=getattr(args, "kv_events_replay", None))
    except ValueError as e:
        return fail("attach", f"--vllm: {e}", 2)
    VConsoleApp(source=source, readonly=bool(getattr(args, "readonly", False))).run()
    return 0


def main_replay(args: argparse.Namespace) -> int:
    """Drive the console from a recorded file at ``--speed`` (read-only)."""
    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.stream import ReplaySource
    from vconsole.telemetry.record import RecordFormatError, read_header

    path = Path(args.file)
    try:
        with open(path, "rb") as fh:
            read_header(fh)
    except (OSError, RecordFormatError) as e:
        return fail("replay", e, 2)
    speed = float(getattr(args, "speed", 1.0) or 1.0)
    app = VConsoleApp(source=ReplaySource(path, speed=speed))
    app.run()
    return 0
