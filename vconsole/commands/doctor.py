"""`vconsole doctor`: check this machine for vconsole (`vconsole.tools.doctor`)."""

from __future__ import annotations

import argparse
import json

from vconsole.commands.flags import env_base_port
from vconsole.security.endpoints import DEFAULTS
from vconsole.tools.doctor import FAIL, as_json, run_checks


def where(args: argparse.Namespace, endpoints: dict[str, str]) -> str:
    """Whose endpoints these are, for the report: the defaults, a base port and where it came
    from (`vconsole.commands.flags.apply_base_port` has already applied it), or the flags."""
    base = getattr(args, "base_port", None)
    if base:
        source = "$VCONSOLE_BASE_PORT" if env_base_port() == base else "--base-port"
        moved = all(endpoints[n] == f"tcp://127.0.0.1:{base + i}" for i, n in enumerate(DEFAULTS))
        return f"base port {base} ({source})" if moved else f"base port {base} and flags"
    return "the defaults" if endpoints == DEFAULTS else "the endpoints given"


def main(args: argparse.Namespace) -> int:
    endpoints = {name: getattr(args, name, None) or default for name, default in DEFAULTS.items()}
    checks = run_checks(endpoints, where(args, endpoints))
    if args.json:
        print(json.dumps(as_json(checks)))
    else:
        for check in checks:
            print(check.line())
    return 1 if any(c.status == FAIL for c in checks) else 0
