"""`vconsole record`'s parser (its handler: `vconsole.commands.record`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.attach_flags import add_target_args
from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "record", "vconsole.commands.record:main",
                    "save the telemetry stream to a file")
    add_client_args(p, vllm=True)
    p.add_argument("file", metavar="FILE")
    p.add_argument("--duration", type=float,
                   help="stop after this many seconds (default: until Ctrl-C)")
    add_target_args(p)
