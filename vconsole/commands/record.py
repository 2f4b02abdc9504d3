"""`vconsole record FILE`: save the telemetry stream to a file."""

from __future__ import annotations

import argparse
import sys

from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_TELEMETRY
from vconsole.telemetry.record import record_stream


def main(args: argparse.Namespace) -> int:
    """`vconsole record FILE [--telemetry EP] [--duration S]`."""
    endpoint = getattr(args, "telemetry", None) or DEFAULT_TELEMETRY
    duration = getattr(args, "duration", None)
    try:
        curve = client_curve(args)
    except CurveKeyError as e:
        print(f"vconsole record: {e}", file=sys.stderr)
        return 2
    print(f"recording {endpoint} to {args.file}"
          + (f" for {duration:g} s" if duration else " until Ctrl-C"), file=sys.stderr)
    counts = record_stream(endpoint, args.file, duration, curve=curve)
    total = sum(counts.values())
    detail = ", ".join(f"{t} {n}" for t, n in counts.items() if n)
    print(f"recorded {total} messages to {args.file}" + (f" ({detail})" if detail else ""))
    if not total:
        print(f"note: nothing arrived from {endpoint}; is the engine running?", file=sys.stderr)
    return 0
