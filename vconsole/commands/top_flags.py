"""`vconsole top`'s parser (its handler: `vconsole.commands.top`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.attach_flags import add_target_args
from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "top", "vconsole.commands.top:main",
                    "a telemetry snapshot for scripts")
    add_client_args(p, vllm=True)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for every topic (default 10)")
    add_target_args(p, prometheus=True)
