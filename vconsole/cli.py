"""`vconsole` — the command line: the table of commands. Each command owns its parser.

A command's handler lives in ``vconsole/commands/NAME.py`` (it takes the parsed
``argparse.Namespace`` and returns an exit code) and its parser beside it in
``vconsole/commands/NAME_flags.py``, whose ``add_parsers(subparsers)`` declares the command (or
the module's commands: `control_flags` declares `set` and `get`), its flags and its handler,
named as ``"vconsole.commands.NAME:function"`` (`vconsole.commands.subcommand.add_command`).
The handler's module is imported only when its command runs, so `vconsole --help` starts fast and
a command's heavy imports (torch, textual, the engine) load for that command alone. A
``*_flags`` module imports only the standard library and plain data: the import contract "cli"
holds this module, and so every parser module it imports, to that. Flag groups several commands
take live in `vconsole.commands.flags`; `vconsole bench`'s benchmarks are subcommands of their
own (`vconsole.commands.bench_flags`).

A new command: its handler module, its ``NAME_flags.py``, and a line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Protocol

from vconsole import __version__
from vconsole.commands import (
    attach_flags,
    bench_flags,
    control_flags,
    demo_flags,
    doctor_flags,
    engine_flags,
    generate_flags,
    keys_flags,
    load_flags,
    profile_flags,
    record_flags,
    serve_flags,
    stacks_flags,
    top_flags,
    trace_flags,
    whatif_flags,
)
from vconsole.commands.flags import apply_base_port
from vconsole.commands.subcommand import Subcommands, SubParsers


class CommandModule(Protocol):
    """A ``vconsole/commands/NAME_flags.py`` module."""

    def add_parsers(self, subparsers: SubParsers) -> None: ...


# In `vconsole --help`'s order.
COMMANDS: tuple[CommandModule, ...] = (
    demo_flags, engine_flags, serve_flags, attach_flags, generate_flags, load_flags,
    control_flags, profile_flags, top_flags, stacks_flags, bench_flags, record_flags,
    trace_flags, keys_flags, doctor_flags, whatif_flags,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vconsole",
        description="A live LLM inference engine and the terminal console that watches and "
                    "steers it.",
        epilog="Run `vconsole SUBCOMMAND --help` for a subcommand's flags. Start with "
               "`vconsole demo`.",
    )
    parser.add_argument("--version", action="version", version=f"vconsole {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", action=Subcommands)
    for module in COMMANDS:
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:            # bare `vconsole`: what there is, not an error line
        parser.print_help()
        return 2
    try:
        apply_base_port(args)
    except ValueError as e:
        print(f"vconsole: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:             # `vconsole get | head`: the reader left, as for `yes`
        _silence_stdout()
        return 128 + 13                 # as if killed by SIGPIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush raises nothing more."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
