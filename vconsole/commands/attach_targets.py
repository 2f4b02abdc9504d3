"""The targets the fleet flags of `vconsole attach` and `vconsole top` name (``--target
KIND=URL``, ``--fleet FILE``, ``--discover HOST:PORT-PORT``; declared by
`vconsole.commands.attach_flags.add_target_args`), as `vconsole.console.sources.fleet` targets."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vconsole.console.sources.fleet.prometheus_query import PrometheusSource


def has_targets(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "target", None) or getattr(args, "fleet", None)
                or getattr(args, "discover", None) or getattr(args, "prometheus", None)
                or getattr(args, "selector", None))


def prometheus_source(args: argparse.Namespace) -> PrometheusSource:
    """The `PrometheusSource` ``--prometheus`` / ``--selector`` name (nothing contacted yet);
    `TargetError` for a flag that cannot be used."""
    from vconsole.console.sources.fleet.prometheus_query import PrometheusSource
    from vconsole.console.sources.fleet.promql import SelectorError
    from vconsole.console.sources.fleet.targets import TargetError

    if not getattr(args, "prometheus", None):
        raise TargetError("--selector: only with --prometheus URL")
    mixed = [f for f in ("target", "fleet", "discover") if getattr(args, f, None)]
    if mixed:
        raise TargetError(f"--prometheus: not with --{mixed[0]} (the fleet is what "
                          "Prometheus scrapes; narrow it with --selector)")
    try:
        return PrometheusSource(args.prometheus, getattr(args, "selector", None))
    except (ValueError, SelectorError) as e:
        raise TargetError(str(e)) from None


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
