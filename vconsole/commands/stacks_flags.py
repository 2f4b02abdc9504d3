"""`vconsole stacks`'s parser (its handler: `vconsole.commands.stacks`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "stacks", "vconsole.commands.stacks:main",
        "every thread of the engine process and its Python stack, now",
        "Print each thread of the engine process (its pid from the engine's health "
        "telemetry, found by the endpoint flags as for `top`) with its Python frames, the "
        "busy loop's thread first: by py-spy where the OS lets it read the engine, else by "
        "the engine's own dump (SIGUSR2). The first line says which. Run it on the "
        "engine's host.")
    add_client_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--native", action="store_true",
                   help="C/C++ frames too (needs py-spy and ptrace permission)")
    p.add_argument("--method", choices=["auto", "py-spy", "signal"], default="auto",
                   help="auto (default): py-spy, else the engine's SIGUSR2 dump")
    p.add_argument("--pid", type=int, metavar="PID",
                   help="this engine process instead of the one the telemetry names")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: rank R's process (default: the first heard)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the engine's health telemetry (default 10)")
