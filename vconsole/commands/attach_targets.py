"""The targets the fleet flags of `vconsole attach` and `vconsole top` name (``--target
KIND=URL``, ``--fleet FILE``, ``--discover HOST:PORT-PORT``; declared by
`vconsole.commands.attach_flags.add_target_args`), as `vconsole.console.sources.fleet` targets."""

from __future__ import annotations

import argparse
import sys


def has_targets(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "target", None) or getattr(args, "fleet", None)
                or getattr(args, "discover", None))


def targets_from(args: argparse.Namespace) -> list:   # list[Target]
    """Every target the flags name, in order (targets, file, discovered); `TargetError` for a
    flag that cannot be used. What discovery skipped goes to stderr, one line a port."""
    from vconsole.console.sources.fleet.detect import discover
    from vconsole.console.sources.fleet.targets import (
        TargetError,
        load_fleet,
        parse_range,
        parse_target,
        unique_names,
    )

    out = [parse_target(t) for t in getattr(args, "target", None) or []]
    if getattr(args, "fleet", None):
        out += load_fleet(args.fleet)
    for spec in getattr(args, "discover", None) or []:
        host, ports = parse_range(spec)
        found, skipped = discover(host, ports)
        for line in skipped:
            print(f"--discover: skipped {line}", file=sys.stderr)
        if not found:
            raise TargetError(f"--discover {spec}: no engine answered on {len(ports)} port(s)")
        out += found
    return unique_names(out)
