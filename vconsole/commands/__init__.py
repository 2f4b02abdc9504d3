"""The CLI's commands: a handler module per command group (``NAME.py``) and its parser beside it
(``NAME_flags.py``); `vconsole.cli` is the table of them."""

from __future__ import annotations

import sys


def fail(command: str, message: object, code: int = 1) -> int:
    """Print ``vconsole COMMAND: MESSAGE`` to stderr and return the exit code: 2 for a usage
    or input error (bad flag, unreadable file), 1 when the command ran and failed."""
    print(f"vconsole {command}: {message}", file=sys.stderr)
    return code
