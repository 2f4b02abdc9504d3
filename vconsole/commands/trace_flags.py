"""`vconsole trace`'s parser (its handler: `vconsole.commands.trace`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "trace", "vconsole.commands.trace:main",
        "save a running engine's request trace (its last minutes) to a file",
        "Ask the engine for the request trace it keeps in memory (its last 5 minutes: one "
        "JSON line per finished request, with lengths and prefix block hashes but never "
        "text, and per step) and write it to FILE, for `vconsole whatif` and `vconsole "
        "load --trace`. No control key needed.")
    add_client_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="where to write it (- : stdout)")
    p.add_argument("--window", type=float, metavar="S",
                   help="only the last S seconds (default: all the engine keeps, 300 s)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the engine's answer (default 60)")
