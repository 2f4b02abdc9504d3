"""`vconsole profile --steps N`: profile the engine's next N steps and print where the time went.

Sends ``profile_start`` (the control key required, as for `vconsole set`), polls
``profile_status`` with progress on stderr, then prints the result: the step phase shares, the
time per layer type and the top operators by self time (or, with ``--json``, the result as the
engine sent it). The engine profiles only while it runs steps, so an idle engine makes this wait;
``--timeout`` bounds the wait, after which (as on Ctrl-C) the profile is cancelled.

``--nsys``: no torch.profiler; the engine opens Nsight Systems' capture range
(``cudaProfilerStart``) now and closes it (``cudaProfilerStop``) after N steps, for an engine run
under ``nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi``; with ``--set nvtx=true``
the steps' phases and layers are named ranges on that timeline. A CPU engine refuses it.

Exit codes as `vconsole set`: 0 the profile is done, 1 refused (no key, one already running),
failed, timed out or no engine answering (the reason on stderr), 2 a usage error caught before
anything was sent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from vconsole.commands import fail
from vconsole.commands.control import _endpoint, _read_key
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import CurveKeyError
from vconsole.wire.control import PROFILE_MAX_STEPS, ControlError
from vconsole.wire.control_client import ControlClient

REQUEST_TIMEOUT_S = 10.0   # one control round trip (profile_start waits for a step boundary)
POLL_S = 0.2
IDLE_HINT_S = 3.0          # no step for this long: say why the profile does not move


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.steps <= PROFILE_MAX_STEPS:
        print(f"vconsole profile: --steps must be from 1 to {PROFILE_MAX_STEPS}, got "
              f"{args.steps}", file=sys.stderr)
        return 2
    try:
        key = _read_key(args)
        client = ControlClient(_endpoint(args), timeout_s=REQUEST_TIMEOUT_S, key=key,
                               curve=client_curve(args))
    except CurveKeyError as e:
        return fail("profile", e, 2)
    except ControlError as e:
        return fail("profile", e)
    with client:
        try:
            status = client.profile_start(args.steps, nsys=getattr(args, "nsys", False))
        except (TimeoutError, ControlError) as e:
            return fail("profile", e)
        try:
            status = _wait(client, status, args.timeout, sys.stderr)
        except KeyboardInterrupt:
            _cancel(client, status["id"], "interrupted")
            raise
        except (TimeoutError, ControlError) as e:
            return fail("profile", e)
    if status["state"] != "done":
        return fail("profile", f"profile {status['id']} {status['state']}: {status.get('error')}")
    result = status["result"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render_nsys(result) if result.get("kind") == "nsys" else render(result))
    return 0


def render_nsys(result: dict[str, Any]) -> str:
    """An nsys capture range: which steps it held, and how to read them."""
    ranges = ("NVTX ranges on: step, schedule, execute, update and each layer are named"
              if result.get("nvtx_ranges") else
              "NVTX ranges off: `vconsole set nvtx=true` names the steps' phases and layers")
    return "\n".join([
        f"profile {result.get('id', '?')}: nsys capture range (cudaProfilerStart/Stop) held "
        f"{result['steps']} steps (engine steps {result['first_step'] + 1}-"
        f"{result['last_step']}) on {result['device']}, {result['wall_s']:.2f} s wall",
        ranges, f"note: {result['note']}"])


def _wait(client: ControlClient, status: dict[str, Any], timeout_s: float,
          err: TextIO) -> dict[str, Any]:
    """Poll until the profile is over; progress on ``err``. Cancels it at ``timeout_s``."""
    pid, steps = status["id"], status["steps"]
    tty = err.isatty()
    deadline = time.monotonic() + timeout_s
    shown, moved, hinted = -1, time.monotonic(), False
    while status["state"] == "running":
        done = status["steps_done"]
        now = time.monotonic()
        if done != shown:
            text = (f"profile {pid}: {done}/{steps} steps" if done < steps
                    else f"profile {pid}: {steps}/{steps} steps, building the report")
            print(f"\r{text}" if tty else text, end="" if tty else "\n", file=err, flush=True)
            shown, moved = done, now
        elif not hinted and now - moved > IDLE_HINT_S and done < steps:
            print(("\n" if tty else "") + f"profile {pid}: waiting for steps (the engine "
                  "profiles only while it serves requests)", file=err, flush=True)
            hinted = True
        if now >= deadline:
            if tty:
                print(file=err)
            _cancel(client, pid, "timed out")
            raise TimeoutError(f"profile {pid} did not finish within {timeout_s:g} s "
                               f"({done}/{steps} steps); it was cancelled. Is the engine "
                               "under load? Raise --timeout or profile fewer --steps")
        time.sleep(POLL_S)
        status = client.profile_status(pid)
    if tty:
        print(file=err)
    return status


def _cancel(client: ControlClient, pid: str, why: str) -> None:
    try:
        client.profile_cancel(pid)
        print(f"vconsole profile: {why}: profile {pid} cancelled", file=sys.stderr)
    except (TimeoutError, ControlError) as e:
        print(f"vconsole profile: {why}; cancelling profile {pid} failed: {e}", file=sys.stderr)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def render(result: dict[str, Any]) -> str:
    """The result as the tables people read."""
    lines = [f"profile {result.get('id', '?')}: {result['steps']} steps (engine steps "
             f"{result['first_step'] + 1}-{result['last_step']}) on {result['device']}, "
             f"{result['wall_s']:.2f} s wall, mean step {_ms(result['mean_step_s'])}",
             f"note: {result['slowdown_note']}", "",
             "step phases (the engine's own step timings over the same steps)"]
    for phase, share in result["phases"].items():
        lines.append(f"  {phase:<10} {share:>6.1%}  {_ms(result['phase_s'][phase]):>12}")
    layers = result["layers"]
    total = sum(layers.values()) or 1.0
    lines += ["", f"time by layer type ({result['layers_clock'].upper()} time, inclusive)"]
    for kind, seconds in layers.items():
        lines.append(f"  {kind:<10} {_ms(seconds):>12}  {seconds / total:>6.1%}")
    clock = "CUDA" if result["sort_by"] == "self_cuda_s" else "CPU"
    ops = result["ops"]
    width = max([len("operator"), *(len(op["name"]) for op in ops)])
    width = min(width, 48)
    lines += ["", f"top {len(ops)} operators by self {clock} time",
              f"  {'operator':<{width}} {'self CPU':>12} {'self CUDA':>12} {'calls':>8}"]
    for op in ops:
        name = op["name"] if len(op["name"]) <= width else op["name"][:width - 1] + "…"
        cuda = _ms(op["self_cuda_s"]) if result["device"] == "cuda" else "–"
        lines.append(f"  {name:<{width}} {_ms(op['self_cpu_s']):>12} {cuda:>12} "
                     f"{op['calls']:>8,}")
    return "\n".join(lines)
