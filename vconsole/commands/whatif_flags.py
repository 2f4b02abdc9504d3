"""`vconsole whatif`'s parser (its handler: `vconsole.commands.whatif`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "whatif", "vconsole.commands.whatif:main",
        "predict a config change's effect from a request trace",
        "Replay a request trace (`vconsole engine --request-trace FILE`, `vconsole trace`, "
        "or a public CSV trace) through the engine's own scheduler and KV cache manager, "
        "with each step's time from a model fitted on the trace's own steps: first the "
        "trace's config (checked against what the trace observed), then each variant. "
        "The --set flags together form one variant; each --compare adds another.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one change of the first variant (repeatable)")
    p.add_argument("--compare", action="append", default=[], metavar="'K=V,K=V'",
                   help="another variant, its changes comma-separated (repeatable)")
    p.add_argument("--costs", metavar="TRACE",
                   help="fit the step costs on this trace (needed for a CSV trace: it has no "
                        "step records)")
    p.add_argument("--validate", action="store_true",
                   help="also run the real engine on the trace for the baseline and each "
                        "variant (the trace's model, as long as the trace) and print the "
                        "prediction errors")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the step costs of the shapes the variants need (rows x "
                        "context x prefill chunk) on an engine of the trace's model started "
                        "for it, kept beside the trace as FILE.calib.jsonl; every later "
                        "prediction on FILE uses it")
    p.add_argument("--no-intervals", action="store_true",
                   help="skip the intervals (each costs four more simulations per variant)")
    p.add_argument("--json", action="store_true", help="print JSON")
