"""`vconsole trace --out FILE [--window S]`: save a running engine's request trace to a file.

The engine keeps its last minutes of request trace in memory, always (`vconsole.engine.process.
request_trace`); this asks for them over the control socket (``get_trace``: no control key
needed, the trace holds no text) and writes them whole to FILE (``-``: stdout) as the trace's
JSON lines, for `vconsole whatif` and `vconsole load --trace`. The engine is found as `vconsole
get` finds it (``--control``, ``--base-port``).

Exit codes: 0 written (also when no request finished in the window: a note says so), 1 no
engine answering or the file cannot be written, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL
from vconsole.telemetry.record import count_trace_lines, fetch_trace, save_trace
from vconsole.wire.control import ControlError


def main(args: argparse.Namespace) -> int:
    window = args.window
    if window is not None and not window > 0:
        return fail("trace", f"--window must be a number of seconds > 0, got {window:g}", 2)
    control = getattr(args, "control", None) or DEFAULT_CONTROL
    try:
        text = fetch_trace(control, window, curve=client_curve(args), timeout_s=args.timeout)
    except CurveKeyError as e:
        return fail("trace", e, 2)
    except (TimeoutError, ControlError) as e:
        return fail("trace", e)
    if args.out == "-":
        sys.stdout.write(text)
        counts = count_trace_lines(text)
    else:
        try:
            counts = save_trace(args.out, text)
        except OSError as e:
            return fail("trace", f"cannot write {args.out}: {e.strerror or e}")
    span = "the whole window the engine keeps" if window is None else f"the last {window:g} s"
    where = "stdout" if args.out == "-" else args.out
    print(f"{counts['request']} requests and {counts['step']} steps ({span}) to {where}",
          file=sys.stderr if args.out == "-" else sys.stdout)
    if not counts["request"]:
        print("vconsole trace: note: no request finished in that time: nothing to replay yet",
              file=sys.stderr)
    return 0
