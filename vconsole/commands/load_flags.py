"""`vconsole load`'s parser (its handler: `vconsole.commands.load`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_client_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "load", "vconsole.commands.load:main",
                    "a load generator client against a running engine")
    add_client_args(p)
    g = p.add_argument_group("HTTP (an OpenAI-compatible server instead of the engine's socket)")
    g.add_argument("--api-url", metavar="URL",
                   help="send streaming /v1/completions to this server, e.g. "
                        "http://127.0.0.1:8000/v1 (`vconsole serve`, or vLLM)")
    g.add_argument("--api-key", metavar="KEY", help="the server's API key, if it has one")
    g.add_argument("--model", metavar="NAME", help="the served model (default: its first)")
    p.add_argument("--num", type=int, help="requests to send (default 100)")
    p.add_argument("--rate", type=float,
                   help="Poisson arrival rate, req/s (default: none, all sent at once)")
    p.add_argument("--concurrency", type=int,
                   help="keep at most this many requests in flight (default: no limit)")
    p.add_argument("--prompt-len", metavar="LO:HI",
                   help="prompt length range in tokens (default 16:128)")
    p.add_argument("--output-len", metavar="LO:HI",
                   help="output length range in tokens (default 16:64)")
    p.add_argument("--priority-mix", metavar="P:W,...",
                   help="priority:weight pairs, e.g. 0:1,5:3 (default 0:1)")
    p.add_argument("--prompts", choices=("tokens", "chat", "auto"),
                   help="tokens: random token ids of --prompt-len, run to their length "
                        "(default); chat: built-in questions, instructions and shared system "
                        "prompts through the model's chat template, ending at its end of turn; "
                        "auto: chat unless the model is a random-weight built-in")
    p.add_argument("--seed", type=int, help="the workload's seed (default 0)")
    g = p.add_argument_group("trace replay (instead of the workload flags above)")
    g.add_argument("--trace", metavar="FILE",
                   help="replay a request trace (`vconsole engine --request-trace`, or a "
                        "public CSV): its arrivals, prompt lengths, shared prefixes, output "
                        "lengths and priorities")
    g.add_argument("--speed", type=float, metavar="X",
                   help="with --trace: arrivals X times as fast (default 1)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--wait", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the engine to answer, e.g. one started just "
                        "before that is still loading its model (default 60)")
