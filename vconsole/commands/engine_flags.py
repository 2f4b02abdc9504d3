"""`vconsole engine`'s parser (its handler: `vconsole.commands.engine`). Its flags are
`vconsole.commands.flags.add_engine_command_args`, shared with `vconsole serve`, which starts the
same engine. Light imports only: `vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_engine_command_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "engine", "vconsole.commands.engine:main",
                    "run the EngineCore process (restarted if it dies)")
    add_engine_command_args(p)
