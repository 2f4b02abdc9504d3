"""`vconsole generate`'s parser (its handler: `vconsole.commands.generate`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_engine_args
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "generate", "vconsole.commands.generate:main",
        "offline batch inference from a JSONL file",
        "Run every line of FILE.jsonl as one request and write one result line per input "
        "line, in input order. Fields of an input line: prompt (text) or prompt_token_ids "
        "(list of ints), and optionally max_tokens, temperature, top_p, top_k, seed, "
        "ignore_eos, stop_token_ids, priority. Output lines: index, output_token_ids, text, "
        "finish_reason, num_prompt_tokens, num_cached_tokens (and error). A bad line gets "
        "an error line, is named on stderr with its line number, and makes the exit code 1; "
        "the other lines still run.")
    add_engine_args(p)
    p.add_argument("--input", required=True, metavar="FILE.jsonl",
                   help='one request per line: {"prompt": ...} or {"prompt_token_ids": [...]}')
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="results, input order")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
