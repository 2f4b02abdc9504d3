"""How a command declares itself: its parser, and its handler named by ``"module:function"``.

`add_command` adds one subcommand to `vconsole`'s subparsers (or to `vconsole bench`'s) and sets
its ``func`` to a `Handler`, which imports the handler's module only when that command runs: a
command's heavy imports (torch, textual, the engine) never load for `vconsole --help` or for
another command. `Subcommands` is the subparsers action both levels use, so that a subcommand
reports its own unknown flags. Standard library only: `vconsole --help` imports this.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import Any

# What a command module's ``add_parsers`` receives: `vconsole`'s (or `vconsole bench`'s)
# subparsers, as ``ArgumentParser.add_subparsers`` returns them.
SubParsers = argparse._SubParsersAction


class Handler:
    """A command's handler, ``"module:function"``, imported when called. The function takes the
    parsed ``argparse.Namespace`` and returns an exit code (None: 0)."""

    def __init__(self, target: str) -> None:
        self.module_name, self.func_name = target.split(":")
        self.target = target

    def __call__(self, args: argparse.Namespace) -> int:
        try:
            module = importlib.import_module(self.module_name)
        except ModuleNotFoundError as e:
            if e.name != self.module_name:
                raise
            print(f"vconsole {args.command}: not yet available in this build", file=sys.stderr)
            return 2
        return int(getattr(module, self.func_name)(args) or 0)

    def __repr__(self) -> str:
        return f"Handler({self.target!r})"


def add_command(subparsers: SubParsers, name: str, handler: str | None, help_: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """Add ``name`` with its one-line ``help_`` (the list in the parent's ``--help``) and its
    ``description`` (the top of its own ``--help``; default: ``help_``); ``handler`` is
    ``"module:function"``, or None for a command whose own subcommands name theirs (`vconsole
    bench`). Returns the new parser, for the command's flags."""
    p: argparse.ArgumentParser = subparsers.add_parser(name, help=help_,
                                                       description=description or help_)
    if handler is not None:
        p.set_defaults(func=Handler(handler))
    return p


class Subcommands(SubParsers):
    """Subcommands that own their errors. argparse's own action lets a subcommand collect the
    arguments it does not know and hands them to the parent parser, which then prints the
    parent's usage (``vconsole engine --modle tiny`` showed ``usage: vconsole [-h]
    [--version] SUBCOMMAND``); here the subcommand's parser reports them, with its own usage
    and the nearest flag it does have."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            sub = self._name_parser_map[values[0]]
            sub.error(f"unrecognized arguments: {' '.join(extras)}{_suggestion(sub, extras)}")


class ListFormatter(argparse.HelpFormatter):
    """argparse's help formatter, but the column of a subcommand list fits its longest name:
    argparse measures the names without their indent, so ``kv-grouping`` went onto a line of its
    own with its help below it."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction) and action.help is not argparse.SUPPRESS:
            indent = self._current_indent + self._indent_increment
            for sub in action._get_subactions():
                width = len(self._format_action_invocation(sub)) + indent
                self._action_max_length = max(self._action_max_length, width)


def _suggestion(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """`` (did you mean --model?)`` for the first unknown flag close to one of ``parser``'s."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")
             and a.help is not argparse.SUPPRESS]
    for arg in extras:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""
