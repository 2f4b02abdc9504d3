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

Data parallel: every rank is a process of its own, and one report is one process: rank
``--rank R``'s, by default rank 0's. The report's first line says which (``pid 1234, rank 0 of
2: ...``) and, for the default, stderr says how to read another rank's.

Exit codes: 0 printed, 1 no stacks (no engine answering, the OS refused; the reason and what to
change on stderr), 2 a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, NamedTuple

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
    if args.rank is not None and args.rank < 0:
        return fail("stacks", f"--rank must be a rank (0 or more), got {args.rank}", 2)
    who: EngineIdentity | None = None
    if pid is None:
        try:
            who = engine_identity(args.telemetry or DEFAULT_TELEMETRY, args.timeout,
                                  client_curve(args), rank=args.rank)
        except CurveKeyError as e:
            return fail("stacks", e, 2)
        except LookupError as e:
            return fail("stacks", e)
        pid = who.pid
    try:
        report = stacks.capture(pid, method=args.method, native=args.native,
                                host=who.host if who else None,
                                start=who.start if who else None)
    except stacks.StacksError as e:
        return fail("stacks", e)
    if who is not None and who.world_size > 1:
        report = dataclasses.replace(report, rank=who.rank, world_size=who.world_size)
        if args.rank is None:
            others = "1" if who.world_size == 2 else f"1..{who.world_size - 1}"
            print(f"vconsole stacks: rank {who.rank} of a data-parallel group of "
                  f"{who.world_size} (each rank is its own process); --rank {others} for "
                  "another rank's", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    return 0


class EngineIdentity(NamedTuple):
    """Which process to read: its ``pid``, machine (``host``) and start (``pid_start``; these
    two None from an engine that does not send them), its data-parallel ``rank`` (0 for a
    lone engine) and the group's size (1 for a lone engine)."""

    pid: int
    host: Any
    start: int | None
    rank: int
    world_size: int


def engine_identity(telemetry: str, timeout_s: float, curve: ClientCurve | None = None, *,
                    rank: int | None = None) -> EngineIdentity:
    """The engine process from its ``health`` heartbeat: rank ``rank``'s in a data-parallel
    group, rank 0's by default (a lone engine is rank 0). The group's size is known by then: a
    rank sends its ``dp`` message in the same pass as its ``health``, just before it.
    LookupError says why there is none."""
    want = 0 if rank is None else rank
    w = Watcher(telemetry, zmq.Context.instance(), curve)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            w.pump(min(0.2, max(0.0, deadline - time.monotonic())))
            health = w.by_rank.get(want, {}).get("health")
            if health is None:
                continue
            body = health.payload
            size = w.world_size()
            if body.get("state") == "restarting":
                which = f"rank {want} of the group" if size > 1 else "the engine"
                hint = " (or --rank R for another rank)" if size > 1 else ""
                raise LookupError(f"{which} on {telemetry} is restarting (no engine process "
                                  f"runs right now); try again in a moment{hint}")
            if isinstance(body.get("pid"), int):
                start = body.get("pid_start")
                return EngineIdentity(int(body["pid"]), body.get("host"),
                                      start if isinstance(start, int) else None, want, size)
        size = w.world_size()
    finally:
        w.close()
    if rank is not None and w.by_rank and size <= rank:
        raise LookupError(f"no rank {rank} on {telemetry}: the group has {size} rank(s) "
                          f"(0..{size - 1})")
    which = f"rank {rank}'s " if rank is not None else ""
    raise LookupError(f"no {which}health telemetry from {telemetry} within {timeout_s:g} s; is "
                      "the engine running? (the endpoint flags or --base-port as for `vconsole "
                      "top`, or --pid PID)")
