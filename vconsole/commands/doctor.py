"""`vconsole doctor`: check this machine for vconsole (`vconsole.tools.doctor`)."""

from __future__ import annotations

import argparse
import json

from vconsole.tools.doctor import FAIL, as_json, run_checks


def main(args: argparse.Namespace) -> int:
    checks = run_checks()
    if args.json:
        print(json.dumps(as_json(checks)))
    else:
        for check in checks:
            print(check.line())
    return 1 if any(c.status == FAIL for c in checks) else 0
