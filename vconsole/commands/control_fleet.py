"""`vconsole set --fleet FILE KEY=VALUE ...`: one config change for every engine of ours in a
fleet file, one engine at a time.

It first lists every engine it will change and every one it will not touch (other kinds are
watched only; an ``auto`` target is ours only when our engine's telemetry answers at its base
port), then asks once: the operator types ``yes`` (``--yes`` for scripts; without a terminal
and without ``--yes`` nothing is sent). Each engine's answer is one line, as `vconsole set`
prints it. Exit codes: 0 every engine applied the change, 1 any engine refused it or did not
answer, 2 a usage error before anything was sent.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from vconsole.commands import fail
from vconsole.commands.control import TIMEOUT_S, _show, parse_pairs
from vconsole.console.sources.fleet.targets import (
    CONTROL_OFFSET,
    Target,
    TargetError,
    load_fleet,
)


def split_fleet(targets: list[Target]) -> tuple[list[Target], list[tuple[Target, str]]]:
    """(our engines, the others with why they are not touched)."""
    from vconsole.console.sources.fleet.detect import resolve

    ours: list[Target] = []
    others: list[tuple[Target, str]] = []
    for t in targets:
        if t.kind == "auto" and t.url.startswith("tcp://"):
            try:
                t = resolve(t, timeout_s=2.0)
            except TargetError as e:
                others.append((t, f"not reached: {e}"))
                continue
        if t.kind == "vconsole":
            ours.append(t)
        else:
            others.append((t, f"{t.kind}: watched only"))
    return ours, others


def set_one(target: Target, values: dict[str, str]) -> tuple[bool, list[str]]:
    """Send the change to one engine of ours: (applied, its answer's lines)."""
    from vconsole.security import control_key
    from vconsole.security.curve import CurveKeyError, load_client_curve
    from vconsole.wire.control import ControlError
    from vconsole.wire.control_client import ControlClient

    endpoint = target.endpoint(CONTROL_OFFSET)
    path = control_key.control_key_file(endpoint, target.control_key_file)
    try:
        key = control_key.read_key_file(path)
    except (OSError, ValueError):
        return False, [f"refused here: cannot read its control key {path} (give "
                       "control_key_file in the fleet file)"]
    try:
        curve = load_client_curve(target.curve.get("server_public"),
                                  target.curve.get("client_key")) if target.curve else None
        with ControlClient(endpoint, timeout_s=TIMEOUT_S, key=key, curve=curve) as client:
            reply: dict[str, Any] = client.set_config(values)
    except (TimeoutError, ControlError, CurveKeyError) as e:
        return False, [f"no answer: {e}"]
    lines = [f"applied  {k} = {_show(v)}" for k, v in (reply.get("applied") or {}).items()]
    lines += [f"rejected  {k}: {why}" for k, why in (reply.get("rejected") or {}).items()]
    lines += [f"restart required  {k}" for k in reply.get("restart_required") or []]
    if reply.get("ok"):
        lines.append(f"config version {reply.get('version')}")
    else:
        lines.append("nothing was applied (a change is all-or-nothing)")
    return bool(reply.get("ok")), lines


def main_set_fleet(args: argparse.Namespace, ask: Callable[[str], str] = input) -> int:
    try:
        values = parse_pairs(args.pairs)
        targets = load_fleet(args.fleet)
    except (ValueError, TargetError) as e:
        return fail("set", e, 2)
    ours, others = split_fleet(targets)
    change = " ".join(f"{k}={v}" for k, v in values.items())
    print(f"vconsole set --fleet: {change} on {len(ours)} engine(s), one at a time:")
    for t in ours:
        print(f"  {t.name}  {t.endpoint(CONTROL_OFFSET)}")
    for t, why in others:
        print(f"  not touched: {t.name} ({why})")
    if not ours:
        return fail("set", f"--fleet {args.fleet}: no engine of ours to change", 1)
    if not getattr(args, "yes", False):
        if not sys.stdin.isatty() and ask is input:
            return fail("set", "not sent: confirm with --yes (no terminal to ask on)", 2)
        try:
            answer = ask(f"Change {change} on these {len(ours)} engine(s)? Type yes to go on: ")
        except EOFError:
            answer = ""
        if answer.strip().lower() != "yes":
            print("not sent: nothing was changed")
            return 1
    failed = 0
    for t in ours:
        ok, lines = set_one(t, values)
        failed += not ok
        for line in lines:
            print(f"{t.name}: {line}", file=sys.stdout if ok else sys.stderr)
    print(f"{len(ours) - failed} of {len(ours)} engine(s) applied the change")
    return 0 if not failed else 1
