"""Every `vconsole` and `make` command the README shows exists with the flags it is shown with:
the README's shell blocks are read and each command line is parsed by the real parser (a
renamed flag or subcommand fails here, not in a newcomer's terminal). The first session also
runs, verbatim, in `test_readme_session.py`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vconsole.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def shell_commands() -> list[str]:
    """Each command of the README's ```sh blocks (comments dropped, `&&` and `|` split)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip().rstrip("&").strip()
            line = re.split(r"\s[<>]", line, maxsplit=1)[0]     # a redirection is the shell's
            for part in re.split(r"&&|\|", line):
                if part.strip():
                    out.append(part.strip())
    return out


def test_the_readme_shows_commands():
    cmds = shell_commands()
    assert any(c.startswith("make demo") for c in cmds)
    assert sum(c.startswith("vconsole ") for c in cmds) >= 8


@pytest.mark.parametrize("line", [c for c in shell_commands() if c.startswith("vconsole ")])
def test_each_vconsole_command_in_the_readme_parses(line):
    argv = shlex.split(line)[1:]
    args = build_parser().parse_args(argv)       # SystemExit(2) on an unknown flag
    assert args.command == argv[0]


def test_each_make_target_in_the_readme_exists():
    makefile = (README.parent / "Makefile").read_text()
    for line in shell_commands():
        if line.startswith("make "):
            target = line.split()[1]
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
