"""`vconsole stacks`: what is the engine doing right now — every thread and its Python stack.

The engine is found as every client command finds it (the endpoint flags, ``--base-port``), and
its process id read from its ``health`` telemetry; ``--pid`` skips that. The stacks come from
`vconsole.shared.stacks`: py-spy where the OS allows it to read the engine (``--native`` adds
C frames and needs it), else the engine's own dump through SIGUSR2. The first line says which
method was used; the busy loop's thread comes first. Stacks are read on the engine's host: the
engine's ``health`` names its machine (``host``: host name and boot id) and its process's start
(``pid_start``), and both are checked before either way reads the pid, so a remote engine's
pid, or a pid reused here by another process, is refused with that reason ("the engine runs on
HOST, not here: run vconsole stacks there"). ``--pid`` is taken as given.

Exit codes: 0 printed, 1 no stacks (no engine answering, the OS refused; the reason and what to
change on stderr), 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import zmq

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import ClientCurve, CurveKeyError
from vconsole.security.endpoints import DEFAULT_TELEMETRY
from vconsole.shared import stacks
from vconsole.tools.top import Watcher


def main(args: argparse.Namespace) -> int:
    pid = args.pid
    if pid is not None and pid <= 0:
        return fail("stacks", f"--pid must be a process id, got {pid}", 2)
    host: Any = None
    start: int | None = None
    if pid is None:
        try:
            pid, host, start = engine_identity(args.telemetry or DEFAULT_TELEMETRY, args.timeout,
                                               client_curve(args), rank=args.rank)
        except CurveKeyError as e:
            return fail("stacks", e, 2)
        except LookupError as e:
            return fail("stacks", e)
    try:
        report = stacks.capture(pid, method=args.method, native=args.native, host=host,
                                start=start)
    except stacks.StacksError as e:
        return fail("stacks", e)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    return 0


def engine_identity(telemetry: str, timeout_s: float, curve: ClientCurve | None = None, *,
                    rank: int | None = None) -> tuple[int, Any, int | None]:
    """The engine process's id, machine and start (``pid``, ``host``, ``pid_start``; the last
    two None from an engine that does not send them) from its ``health`` heartbeat (rank
    ``rank``'s in a data-parallel group, else the first heard). LookupError says why there is
    none."""
    w = Watcher(telemetry, zmq.Context.instance(), curve)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            w.pump(min(0.2, max(0.0, deadline - time.monotonic())))
            msgs = w.by_rank.get(rank, {}) if rank is not None else w.latest
            health = msgs.get("health")
            if health is None:
                continue
            body = health.payload
            if body.get("state") == "restarting":
                raise LookupError(f"the engine on {telemetry} is restarting (no engine process "
                                  "runs right now); try again in a moment")
            if isinstance(body.get("pid"), int):
                start = body.get("pid_start")
                return (int(body["pid"]), body.get("host"),
                        start if isinstance(start, int) else None)
    finally:
        w.close()
    which = f"rank {rank}'s " if rank is not None else ""
    raise LookupError(f"no {which}health telemetry from {telemetry} within {timeout_s:g} s; is "
                      "the engine running? (the endpoint flags or --base-port as for `vconsole "
                      "top`, or --pid PID)")
