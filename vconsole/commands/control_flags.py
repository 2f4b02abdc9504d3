"""`vconsole set` and `vconsole get`'s parsers (their handlers: `vconsole.commands.control`).
Light imports only: `vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "set", "vconsole.commands.control:main_set",
                    "change engine config (hot reload)")
    add_client_args(p, control_key=True)
    p.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: change only rank R (default: every rank)")
    p.add_argument("--fleet", metavar="FILE",
                   help="change every engine of ours in this fleet file (docs/fleet.md), one at "
                        "a time, after listing them and asking once")
    p.add_argument("--yes", action="store_true",
                   help="with --fleet: do not ask (for scripts)")

    p = add_command(subparsers, "get", "vconsole.commands.control:main_get",
                    "print the engine's effective config")
    add_client_args(p, control_key=True)
    p.add_argument("keys", nargs="*", metavar="KEY", help="only these keys")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: read rank R's config (default: rank 0's)")
    p.add_argument("--json", action="store_true", help="print JSON")
