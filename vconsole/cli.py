"""`vconsole` — the command line: one parser, each subcommand handed to the module that owns it.

Subcommands are resolved lazily (``"vconsole.commands.NAME:function"``) so `vconsole --help`
starts fast and a command's heavy imports (torch, textual) load only when it runs. Each handler
takes the parsed ``argparse.Namespace`` and returns an exit code. The flag groups that several
commands share live in `vconsole.commands.flags`; this module is the table of commands.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Callable
from typing import Any

from vconsole.commands import demo_flags
from vconsole.commands.flags import (
    BASE_PORT_ENV,
    add_client_args,
    add_endpoint_args,
    add_engine_args,
    add_engine_command_args,
    apply_base_port,
    int_list,
    port,
)
from vconsole.shared.config import KV_CACHE_DTYPES, QUANTIZATIONS


def _handler(target: str) -> Callable[[argparse.Namespace], int]:
    module_name, func_name = target.split(":")

    def run(args: argparse.Namespace) -> int:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            print(f"vconsole {args.command}: not yet available in this build", file=sys.stderr)
            return 2
        return int(getattr(module, func_name)(args) or 0)

    return run


class _Subcommands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands that own their errors. argparse's own action lets a subcommand collect the
    arguments it does not know and hands them to the top-level parser, which then prints
    `vconsole`'s usage (``vconsole engine --modle tiny`` showed ``usage: vconsole [-h]
    [--version] SUBCOMMAND``); here the subcommand's parser reports them, with its own usage
    and the nearest flag it does have."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            sub = self._name_parser_map[values[0]]
            sub.error(f"unrecognized arguments: {' '.join(extras)}{_suggestion(sub, extras)}")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vconsole",
        description="A live LLM inference engine and the terminal console that watches and "
                    "steers it.",
        epilog="Run `vconsole SUBCOMMAND --help` for a subcommand's flags. Start with "
               "`vconsole demo`.",
    )
    parser.add_argument("--version", action="version", version=f"vconsole {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", action=_Subcommands)

    def cmd(name: str, target: str, help_: str, desc: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=desc or help_)
        p.set_defaults(func=_handler(target))
        return p

    p = cmd("demo", "vconsole.commands.demo:main", "engine + load generator + console in one command",
            demo_flags.DESCRIPTION)
    demo_flags.add_demo_args(p)

    p = cmd("engine", "vconsole.commands.engine:main", "run the EngineCore process (restarted if it dies)")
    add_engine_command_args(p)

    p = cmd("serve", "vconsole.commands.serve:main",
            "an OpenAI-compatible HTTP server in front of the engine",
            "Start the engine (supervised, every `vconsole engine` flag applies) and an HTTP "
            "server in front of it that speaks OpenAI's API as vLLM's server does: "
            "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
            "/detokenize, /load, /version. With --engine-ready-file it fronts an engine that "
            "is already running instead. Use it with the openai SDK, curl or `vllm bench serve`.")
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; beyond loopback, set "
                        "--api-key)")
    g.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` on /v1/ routes "
                        "(default: $VCONSOLE_API_KEY; unset: no key)")
    g.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without --api-key (open to anyone who "
                        "reaches the port)")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients use (default: --model's value)")
    g.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template, instead of the tokenizer's own")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": the model calls tools when it wants, "
                        "read from its text by --tool-call-parser (as vLLM's flag)")
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="how tool calls are read from the text: hermes (<tool_call> blocks, "
                        "the format of Qwen2, Hermes and SmolLM-family templates)")
    g.add_argument("--engine-ready-file", metavar="PATH",
                   help="front the engine that wrote this ready file (`vconsole engine "
                        "--ready-file PATH`) instead of starting one")
    add_engine_command_args(p)

    p = cmd("attach", "vconsole.commands.attach:main", "attach the console to a running engine")
    add_client_args(p, control_key=True, vllm=True)
    p.add_argument("--extra-telemetry", action="append", default=[], metavar="ENDPOINT",
                   help="another engine's telemetry endpoint (e.g. a data-parallel rank)")
    p.add_argument("--readonly", action="store_true", help="watch only: hide every action")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="with --vllm: follow the server's KV events (its --kv-events-config "
                        "endpoint, e.g. tcp://127.0.0.1:5557; rank r on port + r) and show the "
                        "prefix cache's contents")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="with --kv-events: the server's replay endpoint, to catch up a gap")
    g = p.add_argument_group("web (the console in a browser: one console process per tab)")
    g.add_argument("--web", action="store_true",
                   help="serve this console to browsers (textual-serve) instead of running it "
                        "here; prints the URLs, one with a token for tabs that may steer")
    g.add_argument("--host", metavar="HOST",
                   help="with --web: the address (default 127.0.0.1; beyond loopback every tab "
                        "needs the token)")
    g.add_argument("--port", type=port, metavar="PORT",
                   help="with --web: the port (default 8765; 0: a free one)")
    g.add_argument("--no-token", action="store_true",
                   help="with --web: no token, every tab read-only (loopback only)")

    p = cmd("generate", "vconsole.commands.generate:main", "offline batch inference from a JSONL file",
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

    p = cmd("load", "vconsole.commands.load:main", "a load generator client against a running engine")
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

    p = cmd("set", "vconsole.commands.control:main_set", "change engine config (hot reload)")
    add_client_args(p, control_key=True)
    p.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: change only rank R (default: every rank)")

    p = cmd("get", "vconsole.commands.control:main_get", "print the engine's effective config")
    add_client_args(p, control_key=True)
    p.add_argument("keys", nargs="*", metavar="KEY", help="only these keys")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: read rank R's config (default: rank 0's)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = cmd("profile", "vconsole.commands.profile:main",
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

    p = cmd("top", "vconsole.commands.top:main", "a telemetry snapshot for scripts")
    add_client_args(p, vllm=True)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for every topic (default 10)")

    p = cmd("stacks", "vconsole.commands.stacks:main",
            "every thread of the engine process and its Python stack, now",
            "Print each thread of the engine process (its pid from the engine's health "
            "telemetry, found by the endpoint flags as for `top`) with its Python frames, the "
            "busy loop's thread first: by py-spy where the OS lets it read the engine, else by "
            "the engine's own dump (SIGUSR2). The first line says which. Run it on the "
            "engine's host.")
    add_client_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--native", action="store_true",
                   help="C/C++ frames too (needs py-spy and ptrace permission)")
    p.add_argument("--method", choices=["auto", "py-spy", "signal"], default="auto",
                   help="auto (default): py-spy, else the engine's SIGUSR2 dump")
    p.add_argument("--pid", type=int, metavar="PID",
                   help="this engine process instead of the one the telemetry names")
    p.add_argument("--rank", type=int, metavar="R",
                   help="data parallel: rank R's process (default: the first heard)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the engine's health telemetry (default 10)")

    p = cmd("bench", "vconsole.commands.bench:main", "benchmarks, printing JSON")
    p.add_argument("name", choices=["throughput", "scheduler", "kvmap", "telemetry", "console",
                                    "dp", "soak", "serve", "quality", "kv-ideas",
                                    "kv-grouping", "whatif", "structured"],
                   help="which benchmark: model throughput against transformers, the "
                        "scheduler's per-step cost, the KV map's engine-to-console round trip, "
                        "telemetry's cost to throughput, the console's lag and CPU, 2 "
                        "data-parallel ranks against 1 engine, a soak of the demo's load "
                        "(exit 1 unless it passes), the HTTP server against the native "
                        "client, or the engine's perplexity and greedy output against "
                        "transformers' on real text (exit 1 unless it meets the targets), or "
                        "the KV memory ideas (near-duplicate blocks, block sizes, KV dtypes at "
                        "equal memory), or the what-if's prediction errors against the real "
                        "engine (exit 1 unless within the goals), or requests under a JSON "
                        "schema against the same requests unconstrained")
    p.add_argument("--json", action="store_true", help="JSON only (no progress lines)")
    p.add_argument("--num-requests", type=int,
                   help="throughput: override the workload size; telemetry, console: requests "
                        "in the engine (default 20000 / 10000); kv-ideas: requests in the "
                        "demo's workload (default 40); structured: requests per side (default "
                        "64)")
    p.add_argument("--sizes", type=int_list, default=None, metavar="N,N,...",
                   help="scheduler: waiting-queue sizes (default 100,1000,10000,50000)")
    p.add_argument("--steps", type=int, default=300,
                   help="scheduler: measured steps per policy and size (default 300)")
    p.add_argument("--num-blocks", type=int, default=1_000_000,
                   help="kvmap: blocks in the pool (default 1000000)")
    p.add_argument("--rounds", type=int, default=None,
                   help="kvmap: measured round trips (default 30); telemetry: rounds per mode "
                        "(default 200); serve: rounds per level and client (default 2); "
                        "structured: rounds per level and side (default 1)")
    p.add_argument("--seconds", type=float, default=None,
                   help="telemetry: seconds per round (default 0.2); console: seconds per "
                        "measurement (default 4); whatif: seconds of each recorded workload "
                        "(default 90)")
    p.add_argument("--model-config", default="tiny", metavar="NAME",
                   help="throughput, serve: the built-in model to run: tiny (default), "
                        "small-gqa or smollm2")
    p.add_argument("--concurrency", type=int_list, default=None, metavar="N,N,...",
                   help="serve: concurrency levels (default 1,8,32); structured: (default "
                        "1,32)")
    p.add_argument("--no-transformers", action="store_true",
                   help="serve: skip the comparison with `transformers serve "
                        "--continuous-batching` (run where transformers' CLI and accelerate "
                        "are installed); throughput: skip transformers' generate and "
                        "generate_batch")
    p.add_argument("--peer", choices=["llama-cpp"], default=None,
                   help="throughput: also run llama.cpp (llama-cpp-python, the llama-cpp "
                        "extra) on smollm2's own Q4_1 GGUF, single stream and the requests "
                        "one by one, with the same threads")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="throughput: torch's threads (and llama.cpp's) for the run (default: "
                        "torch's)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="soak: how long the load runs (default 10)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="soak: run the engine as N data-parallel ranks (default 1)")
    p.add_argument("--data-parallel-backend", choices=["mp", "ray"], default="mp",
                   help="soak: how the ranks run (mp processes, or ray actors); dp: ray "
                        "compares a 2-rank group of Ray actors with the mp one (start-up "
                        "time, tokens/s)")
    p.add_argument("--rate", type=float, default=8.0,
                   help="soak: the demo's mean request rate, req/s (default 8)")
    p.add_argument("--model", default="smollm2", metavar="M",
                   help="quality, structured: the model, a built-in name, a GGUF file or a "
                        "model directory (default smollm2)")
    p.add_argument("--windows", type=int, default=64, metavar="N",
                   help="quality: perplexity windows of the pydoc text (default 64)")
    p.add_argument("--window-tokens", type=int, default=512, metavar="N",
                   help="quality: tokens per window (default 512)")
    p.add_argument("--chat-prompts", type=int, default=32, metavar="N",
                   help="quality: built-in chat prompts compared greedily (default 32, at most "
                        "32)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N",
                   help="quality: greedy tokens per chat prompt (default 32)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="quality, throughput: the engine's KV cache storage (default auto); "
                        "quality then also runs auto and reports the greedy match against it")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="quality, throughput: the engine's weight quantization (default none)")
    p.add_argument("--runs", type=int, default=5,
                   help="throughput, telemetry: repetitions; the JSON gives each run and the "
                        "median/worst ratios (default 5)")

    p = cmd("record", "vconsole.commands.record:main", "save the telemetry stream to a file")
    add_client_args(p, vllm=True)
    p.add_argument("file", metavar="FILE")
    p.add_argument("--duration", type=float,
                   help="stop after this many seconds (default: until Ctrl-C)")

    p = cmd("trace", "vconsole.commands.trace:main",
            "save a running engine's request trace (its last minutes) to a file",
            "Ask the engine for the request trace it keeps in memory (its last 5 minutes: one "
            "JSON line per finished request, with lengths and prefix block hashes but never "
            "text, and per step) and write it to FILE, for `vconsole whatif` and `vconsole "
            "load --trace`. No control key needed.")
    add_client_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="where to write it (- : stdout)")
    p.add_argument("--window", type=float, metavar="S",
                   help="only the last S seconds (default: all the engine keeps, 300 s)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the engine's answer (default 60)")

    p = cmd("keys", "vconsole.commands.keys:main", "make CURVE key pairs for remote use",
            "Write a CURVE server key pair and a client key pair (zmq.auth certificates; secret "
            "files mode 0600) into DIR, and authorise the client by copying its public key into "
            "DIR/authorized_clients. Run again with --client NAME to add another client; the "
            "server pair is kept. Existing key files are never overwritten.")
    p.add_argument("dir", metavar="DIR", help="where to write the keys (created mode 0700)")
    p.add_argument("--client", default="client", metavar="NAME",
                   help="the client pair's name: NAME.key, NAME.key_secret (default client)")

    p = cmd("doctor", "vconsole.commands.doctor:main", "check this machine for vconsole",
            "One line per check: Python and package versions, the torch build (CPU or CUDA), "
            "GPUs seen by torch and NVML, the engine's ports (the defaults, or --base-port / "
            f"${BASE_PORT_ENV} / the endpoint flags, as for every client command), the cache and "
            "run folders, the control key of those endpoints. Exits 1 when a check fails.")
    add_endpoint_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = cmd("whatif", "vconsole.commands.whatif:main",
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
    p.add_argument("--json", action="store_true", help="print JSON")

    p = cmd("replay", "vconsole.commands.attach:main_replay", "play a recorded stream in the console")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--speed", type=float, default=1.0, help="playback speed (default 1.0)")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vconsole")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
