"""`vconsole bench throughput --peer llama-server`: `vconsole serve` against llama.cpp's own
server on the same GGUF, over HTTP, one client and one workload for both, in the same run.

Both servers get the GGUF (``--model``, default smollm2's own Q4_1 file) and the same threads
(``--threads``, default every core; `throughput_servers` says how each is told). ``vconsole
serve`` runs with its defaults (plus ``--quantization`` when given) and stays up for the whole
run; ``llama-server`` (built by `vconsole.tools.bench.llama_server_build`) is started for each
level with ``--parallel`` equal to its concurrency, so its continuous batching over that many
slots is what is measured — not requests one after another.

The client is `vconsole load --api-url`'s (`HttpLoadClient`: streaming ``/v1/completions``,
token-id prompts, ``ignore_eos``, greedy), with the prompts drawn from vconsole's vocabulary for
both servers, so they see the same token ids. The levels, measured back to back, the two
servers' order alternating from one level to the next:

- **single stream**: `SINGLE_REQUESTS` requests of `PROMPT_LEN` prompt tokens and
  `SINGLE_OUTPUT` output tokens, one at a time: ``decode_tokens_per_s`` is each request's
  tokens after the first over the time from the first to the last (the median request), and
  ``tpot_ms`` its inverse, the time per output token;
- **concurrency C** (1, 8, 32, 64 by default): ``max(2C, 4)`` requests of `PROMPT_LEN` and
  `OUTPUT_LEN` tokens with at most C in flight: output ``tok_per_s`` over the run, TTFT and
  ITL p50/p99, and the median request's time per output token.

``ratio`` at each level is vconsole's figure over llama-server's (tokens/s: above 1 is faster;
``ttft_p99``: below 1 is better). llama-server's own ``llamacpp:tokens_predicted_total`` (its
``--metrics``) is read around each of its runs: ``server_tokens`` must equal the tokens the
client counted. A run where any request failed raises `RequestsFailed` (no figures from it).
The JSON names the CPU and its vector extensions, llama-server's own ``system_info`` line (the
features ggml uses), whether its repacked weight buffers ran (``llama_server_repack``: on a VM
that names AMX but does not grant its tile state they die with SIGILL, and the bench restarts
it with ``--no-repack``; for Q4_1 ggml has no other repacked layout), and the load average at
the start and end, and each row's model-FLOP and memory-bandwidth utilisation against this
machine's peaks (`vconsole.tools.bench.utilisation`; ``peaks``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vconsole.tools.bench.cpu_features import cpu_description
from vconsole.tools.bench.llama_server_build import find_llama_server, missing_reason
from vconsole.tools.bench.throughput_servers import (
    ServerFailed,
    Started,
    died_of_sigill,
    free_port,
    llama_server,
    scrape_counter,
    system_info,
    vconsole_serve,
)
from vconsole.tools.bench.utilisation import add_utilisation
from vconsole.tools.http_load import HttpLoadClient
from vconsole.tools.load_summary import LoadRun
from vconsole.tools.loadgen import LoadSpec, run_load

LEVELS = (1, 8, 32, 64)
PROMPT_LEN = 128
OUTPUT_LEN = 128
SINGLE_OUTPUT = 256
SINGLE_REQUESTS = 3
TOKENS_PREDICTED = "llamacpp:tokens_predicted_total"


class RequestsFailed(RuntimeError):
    """A measured run had requests that did not complete: its figures are not reported."""


@dataclass(frozen=True)
class HttpPlan:
    gguf: Path
    threads: int
    levels: tuple[int, ...] = LEVELS
    quantization: str | None = None
    base_port: int = 0           # 0: free ports; else serve PORT, engine PORT+1.., peer PORT+5


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def figures(run: LoadRun, spec: LoadSpec) -> dict[str, Any]:
    """A completed run's figures; `RequestsFailed` unless every request completed whole."""
    s = run.summary()
    if s["completed"] != spec.num or s["errors"]:
        kinds = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"
        first = "; ".join(f"{k}: {m}" for k, m in s["error_examples"].items())
        raise RequestsFailed(f"{s['completed']} of {spec.num} requests completed "
                             f"(errors: {kinds}){'; ' + first if first else ''}")
    decode = [(r.num_tokens - 1) / (r.last_token - r.first_token)
              for r in run.records.values()
              if r.first_token is not None and r.num_tokens > 1 and r.last_token > r.first_token]
    rate = _median(decode)

    def r6(v: float | None) -> float | None:
        return None if v is None else round(v, 6)

    return {"requests": spec.num, "output_tokens": s["output_tokens"],
            "duration_s": round(s["duration_s"], 3), "tok_per_s": round(s["tok_per_s"], 1),
            "ttft_p50_s": r6(s["ttft_s"]["p50"]), "ttft_p99_s": r6(s["ttft_s"]["p99"]),
            "itl_p50_s": r6(s["itl_s"]["p50"]), "itl_p99_s": r6(s["itl_s"]["p99"]),
            "decode_tokens_per_s": None if rate is None else round(rate, 1),
            "tpot_ms": None if not rate else round(1e3 / rate, 2)}


async def drive(url: str, spec: LoadSpec, vocab: int) -> LoadRun:
    """``spec`` against the OpenAI server at ``url`` (its root), prompts from ``vocab``."""
    # HttpLoadClient has the three calls run_load makes of an engine client (duck-typed)
    client: Any = HttpLoadClient(url, timeout_s=1800.0)
    async with client:
        client.engine_info["vocab_size"] = vocab
        return await run_load(client, spec)


def level_spec(level: int | str) -> LoadSpec:
    if level == "single":
        return LoadSpec(num=SINGLE_REQUESTS, concurrency=1, prompt_len=(PROMPT_LEN, PROMPT_LEN),
                        output_len=(SINGLE_OUTPUT, SINGLE_OUTPUT), seed=7)
    c = int(level)
    return LoadSpec(num=max(2 * c, 4), concurrency=c, prompt_len=(PROMPT_LEN, PROMPT_LEN),
                    output_len=(OUTPUT_LEN, OUTPUT_LEN), seed=c)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if ours and theirs else None


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """vconsole over llama-server at one level."""
    return {"tok_per_s": _ratio(ours["tok_per_s"], theirs["tok_per_s"]),
            "decode_tokens_per_s": _ratio(ours["decode_tokens_per_s"],
                                          theirs["decode_tokens_per_s"]),
            "ttft_p99": _ratio(ours["ttft_p99_s"], theirs["ttft_p99_s"])}


def _vocab(url: str) -> int:
    async def read() -> int:
        async with HttpLoadClient(url) as client:
            return int(client.engine_info["vocab_size"])
    return asyncio.run(read())


def _measure_peer(peer: Started, spec: LoadSpec, vocab: int) -> dict[str, Any]:
    before = scrape_counter(peer.url, TOKENS_PREDICTED)
    out = figures(asyncio.run(drive(peer.url, spec, vocab)), spec)
    after = scrape_counter(peer.url, TOKENS_PREDICTED)
    out["server_tokens"] = None if before is None or after is None else int(after - before)
    return out


def _start_peer(stack: ExitStack, binary: Path, plan: HttpPlan, port: int, parallel: int,
                ctx_per_slot: int, work: Path, result: dict[str, Any],
                log: Callable[[str], None]) -> Started:
    """llama-server with ggml's repacked buffers, as it starts by default; where they kill it
    with SIGILL (`died_of_sigill`), with ``--no-repack`` from then on, said in
    ``result["llama_server_repack"]``."""
    while True:
        repack = result.setdefault("llama_server_repack", True) is True
        try:
            return stack.enter_context(llama_server(binary, plan.gguf, port, plan.threads,
                                                    parallel, ctx_per_slot, work, repack))
        except ServerFailed as e:
            if not (repack and died_of_sigill(e)):
                raise
            result["llama_server_repack"] = (
                "off (--no-repack): its repacked (AMX) buffers died with SIGILL on this CPU")
            log("llama-server died with SIGILL in its repacked buffers: --no-repack")


def http_throughput(plan: HttpPlan, log: Callable[[str], None]) -> dict[str, Any]:
    binary = find_llama_server()
    if binary is None:
        raise SystemExit(f"vconsole bench: --peer llama-server: {missing_reason()}")
    work = Path(tempfile.mkdtemp(prefix="vconsole-bench-peer-"))
    ports = ((plan.base_port, plan.base_port + 1, plan.base_port + 5) if plan.base_port
             else (free_port(), 0, free_port()))
    ctx_per_slot = PROMPT_LEN + max(OUTPUT_LEN, SINGLE_OUTPUT) + 64
    result: dict[str, Any] = {
        "benchmark": "throughput", "peer": "llama-server", "model": str(plan.gguf),
        "threads": plan.threads, "quantization": plan.quantization,
        "llama_server": str(binary), "cpu": cpu_description(),
        "workload": {"prompt_tokens": PROMPT_LEN, "output_tokens": OUTPUT_LEN,
                     "single_stream_output_tokens": SINGLE_OUTPUT, "ignore_eos": True,
                     "greedy": True},
        "load_average": [round(os.getloadavg()[0], 2)], "levels": {}}
    levels: list[int | str] = ["single", *plan.levels]
    result["llama_server_system_info"] = system_info(binary, plan.threads)
    try:
        log(f"starting vconsole serve --model {plan.gguf} ({plan.threads} threads) ...")
        with vconsole_serve(plan.gguf, ports[0], plan.threads, work, plan.quantization,
                            ports[1] or None) as ours:
            vocab = _vocab(ours.url)
            warm = LoadSpec(num=2, concurrency=2, prompt_len=(PROMPT_LEN, PROMPT_LEN),
                            output_len=(8, 8), seed=99)
            asyncio.run(drive(ours.url, warm, vocab))
            for i, level in enumerate(levels):
                parallel = 1 if level == "single" else int(level)
                spec = level_spec(level)
                with ExitStack() as stack:
                    log(f"starting llama-server --parallel {parallel} ...")
                    peer = _start_peer(stack, binary, plan, ports[2], parallel, ctx_per_slot,
                                       work, result, log)
                    asyncio.run(drive(peer.url, warm, vocab))
                    row: dict[str, Any] = {}
                    for name in (("vconsole", "llama_server") if i % 2 == 0
                                 else ("llama_server", "vconsole")):
                        log(f"  {level}: {name} ...")
                        row[name] = (figures(asyncio.run(drive(ours.url, spec, vocab)), spec)
                                     if name == "vconsole" else _measure_peer(peer, spec, vocab))
                        log(f"  {level}: {name}: {row[name]['tok_per_s']} tok/s, "
                            f"{row[name]['decode_tokens_per_s']} tok/s a stream")
                    result["levels"][str(level)] = {
                        "vconsole": row["vconsole"], "llama_server": row["llama_server"],
                        "ratio": compare(row["vconsole"], row["llama_server"]),
                        "llama_server_parallel": parallel}
    finally:
        result["load_average"].append(round(os.getloadavg()[0], 2))
        shutil.rmtree(work, ignore_errors=True)
    single = result["levels"]["single"]
    top = result["levels"].get(str(max(plan.levels)), {}) if plan.levels else {}
    result["single_stream_vs_llama_server"] = single["ratio"]["decode_tokens_per_s"]
    result["top_concurrency_vs_llama_server"] = top.get("ratio", {}).get("tok_per_s")
    # Utilisation against this machine's peaks, measured after both servers are gone.
    add_utilisation(result, plan.gguf, plan.threads, PROMPT_LEN + OUTPUT_LEN // 2)
    result["goal"] = {"single_stream_vs_llama_server": 1.0, "concurrency_64_vs_llama_server": 1.5,
                      "ttft_p99_64_vs_llama_server": "<= 1.0 (issue #47)"}
    return result
