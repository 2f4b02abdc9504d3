"""`vconsole profile`'s parser (its handler: `vconsole.commands.profile`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "profile", "vconsole.commands.profile:main",
        "profile the engine's next N steps (torch.profiler)",
        "Run torch.profiler over the engine's next N steps (it keeps serving, slower) and "
        "print the step phase shares, the time per layer type and the top operators by "
        "self time. Needs the control key, as `set` does.")
    add_client_args(p, control_key=True)
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="steps to profile (default 20, at most 200)")
    p.add_argument("--nsys", action="store_true",
                   help="open Nsight Systems' capture range (cudaProfilerStart/Stop) around "
                        "the next N steps instead, for an engine run under `nsys profile "
                        "--capture-range=cudaProfilerApi` (CUDA only)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="give up (and cancel the profile) after S seconds (default 120)")
