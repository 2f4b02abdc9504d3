"""`vconsole bench NAME`: run a benchmark and print its JSON."""

from __future__ import annotations

import argparse
import json

from vconsole.bench import throughput


def main(args: argparse.Namespace) -> int:
    out = throughput(args)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
