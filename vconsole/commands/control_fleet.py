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

from vconsole.commands import fail
from vconsole.console.sources.fleet.control import parse_pairs, set_one, split
from vconsole.console.sources.fleet.targets import CONTROL_OFFSET, TargetError, load_fleet


def main_set_fleet(args: argparse.Namespace, ask: Callable[[str], str] = input) -> int:
    try:
        values = parse_pairs(args.pairs)
        targets = load_fleet(args.fleet)
    except (ValueError, TargetError) as e:
        return fail("set", e, 2)
    ours, others = split(targets)
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
