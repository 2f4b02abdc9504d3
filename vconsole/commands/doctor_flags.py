"""`vconsole doctor`'s parser (its handler: `vconsole.commands.doctor`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import BASE_PORT_ENV, add_endpoint_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "doctor", "vconsole.commands.doctor:main", "check this machine for vconsole",
        "One line per check: Python and package versions, the torch build (CPU or CUDA), "
        "GPUs seen by torch and NVML, the engine's ports (the defaults, or --base-port / "
        f"${BASE_PORT_ENV} / the endpoint flags, as for every client command), the cache and "
        "run folders, the control key of those endpoints. Exits 1 when a check fails.")
    add_endpoint_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
