"""`vconsole bench serve`: what the HTTP layer costs — `vconsole serve` against the same engine
through its native client, at several concurrencies, in one run.

One engine (tiny model unless ``--model-config``) and one ``vconsole serve --engine-ready-file``
process in front of it. For each concurrency (1, 8, 32 by default) the same workload — random
prompts of ``prompt_len`` token ids, ``output_len`` tokens with ``ignore_eos``, greedy — runs
through the native `AsyncEngineClient` and through the server (`HttpLoadClient`: streaming
``/v1/completions`` as `vllm bench serve` sends them), alternating which goes first, ``rounds``
times. Each run's figures come from `vconsole.tools.loadgen` (the client's own clock): output
tokens/s, TTFT and ITL p50/p99. Reported per concurrency: the medians of both, and the ratios
``http_over_native`` (throughput: goal ≥ 0.9 at the highest concurrency) and
``itl_p99_http_over_native`` (goal ≤ 1.2).

``transformers serve --continuous-batching`` on the same model directory is the peer server
where it can run (the ``transformers`` CLI and ``accelerate``: ``pip install -e '.[compare]'``;
the JSON says when it could not). It takes only plain OpenAI requests (a text prompt, no
``ignore_eos``), so both servers get the same portable workload (`HttpLoadClient` with
``portable=True``), alternating, and the ratios are ``vconsole_over_transformers`` (output
tokens/s; goal ≥ 3 at the highest concurrency) and ``ttft_p99_vconsole_over_transformers``
(goal < 1).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.launch.child import ChildProcess
from vconsole.engine.launch.engine_process import EngineProcess, engine_env_beside_clients
from vconsole.tools.bench.throughput_servers import free_port, wait_healthy
from vconsole.tools.http_load import HttpLoadClient
from vconsole.tools.load_summary import LoadRun
from vconsole.tools.loadgen import LoadSpec, run_load

ENGINE_ARGS = ["--max-num-seqs", "64"]
SERVER_START_S = 120.0


class RequestsFailed(RuntimeError):
    """A measured run had requests that did not complete: its figures are not reported."""


async def _run(client: Any, spec: LoadSpec) -> dict[str, Any]:
    """One run's summary; `RequestsFailed` unless every request completed (the same count as
    `vconsole load`'s: an error event, a cut stream or a short output is a failure)."""
    async with client:
        run: LoadRun = await run_load(client, spec)
    s = run.summary()
    if s["completed"] != spec.num or s["errors"]:
        kinds = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"
        first = "; ".join(f"{k}: {m}" for k, m in s["error_examples"].items())
        raise RequestsFailed(f"{s['completed']} of {spec.num} benchmark requests completed "
                             f"(errors: {kinds}){'; ' + first if first else ''}")
    return s


def _figures(s: dict[str, Any]) -> dict[str, float]:
    return {"tok_per_s": s["tok_per_s"], "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p99_s": s["ttft_s"]["p99"], "itl_p50_s": s["itl_s"]["p50"],
            "itl_p99_s": s["itl_s"]["p99"], "output_tokens": s["output_tokens"]}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 6) for k in runs[0]}


def transformers_serve_missing() -> str | None:
    """Why ``transformers serve`` cannot run here (None when it can)."""
    if shutil.which("transformers") is None and not (
            Path(sys.executable).parent / "transformers").exists():
        return "the transformers CLI is not installed"
    try:
        import accelerate  # noqa: F401  (transformers serve needs it to place the model)
    except ImportError:
        return "accelerate is not installed (pip install -e '.[compare]')"
    return None


def _transformers_cli() -> str:
    local = Path(sys.executable).parent / "transformers"
    return str(local) if local.exists() else "transformers"


def serve_bench(concurrencies: list[int] | None = None, rounds: int = 2, prompt_len: int = 128,
                output_len: int = 64, model: str = "tiny", compare_transformers: bool = True,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda _m: None)
    levels = concurrencies or [1, 8, 32]
    work = Path(tempfile.mkdtemp(prefix="vconsole-bench-serve-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    say(f"starting an engine ({model}) and vconsole serve in front of it ...")
    try:
        # The engine as `vconsole serve` starts it: beside its HTTP server (and this client).
        with EngineProcess(["--model", model, *ENGINE_ARGS],
                           env=engine_env_beside_clients()) as engine:
            server_log = work / "serve.log"
            with open(server_log, "wb") as out:
                server = ChildProcess([sys.executable, "-m", "vconsole", "serve", "--port",
                                       str(port), "--engine-ready-file", str(engine.ready_path)],
                                      stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
            try:
                wait_healthy(url, server, server_log, "vconsole serve", SERVER_START_S)
                results = asyncio.run(_measure(engine.endpoints, url + "/v1", levels, rounds,
                                               prompt_len, output_len, say))
                missing = (transformers_serve_missing() if compare_transformers
                           else "not asked for (--no-transformers)")
                peer: dict[str, Any] | str = f"not compared: {missing}"
                if not missing:
                    try:
                        peer = _against_transformers(url, engine.ready["model_path"], work,
                                                     levels, rounds, prompt_len, output_len,
                                                     say)
                    except Exception as e:   # keep vconsole's own figures; say what failed
                        peer = f"not compared: {type(e).__name__}: {e}"
            finally:
                server.stop(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    top = str(levels[-1])
    by_level = results
    return {
        "model": model, "prompt_len": prompt_len, "output_len": output_len, "rounds": rounds,
        "concurrency": by_level,
        "http_over_native_at_top": by_level[top]["http_over_native"],
        "itl_p99_http_over_native_at_top": by_level[top]["itl_p99_http_over_native"],
        "goals": {"http_over_native_at_top": ">= 0.9", "itl_p99_http_over_native_at_top":
                  "<= 1.2"},
        "transformers_serve": peer,
    }


def _against_transformers(url: str, model_dir: str, work: Path, levels: list[int], rounds: int,
                          prompt_len: int, output_len: int,
                          say: Callable[[str], None]) -> dict[str, Any]:
    """The portable workload against `vconsole serve` (``url``) and ``transformers serve
    --continuous-batching`` on ``model_dir``, alternating; the medians and the ratios."""
    port = free_port()
    peer_url = f"http://127.0.0.1:{port}"
    log_path = work / "transformers-serve.log"
    say(f"starting transformers serve --continuous-batching on {model_dir} ...")
    with open(log_path, "wb") as out:
        peer = ChildProcess([_transformers_cli(), "serve", "--continuous-batching", "--host",
                             "127.0.0.1", "--port", str(port), model_dir],
                            stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(peer_url, peer, log_path, "transformers serve", SERVER_START_S)
        return asyncio.run(_measure_peers({"vconsole": url + "/v1",
                                           "transformers": peer_url + "/v1"},
                                          levels, rounds, prompt_len, output_len, say))
    finally:
        peer.stop(30)


async def _measure_peers(urls: dict[str, str], levels: list[int], rounds: int,
                         prompt_len: int, output_len: int,
                         say: Callable[[str], None]) -> dict[str, Any]:
    warm = LoadSpec(num=4, concurrency=4, prompt_len=(prompt_len, prompt_len),
                    output_len=(4, 4), seed=99)
    for u in urls.values():
        await _run(HttpLoadClient(u, portable=True), warm)
    out: dict[str, Any] = {}
    for c in levels:
        spec = LoadSpec(num=max(2 * c, 16), concurrency=c, prompt_len=(prompt_len, prompt_len),
                        output_len=(output_len, output_len), seed=c)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for r in range(rounds):
            names = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in names:
                runs[name].append(_figures(await _run(HttpLoadClient(urls[name],
                                                                     portable=True), spec)))
                say(f"concurrency {c} round {r + 1} {name} (portable): "
                    f"{runs[name][-1]['tok_per_s']:.0f} tok/s")
        ours, theirs = _median(runs["vconsole"]), _median(runs["transformers"])
        out[str(c)] = {
            "vconsole": ours, "transformers": theirs,
            "vconsole_over_transformers": round(ours["tok_per_s"] / theirs["tok_per_s"], 3)
            if theirs["tok_per_s"] else None,
            "ttft_p99_vconsole_over_transformers":
                round(ours["ttft_p99_s"] / theirs["ttft_p99_s"], 3)
                if theirs["ttft_p99_s"] else None,
            "num_requests": spec.num}
    top = str(levels[-1])
    return {"workload": "text prompts, no ignore_eos (what transformers serve accepts)",
            "concurrency": out,
            "vconsole_over_transformers_at_top": out[top]["vconsole_over_transformers"],
            "goals": {"vconsole_over_transformers_at_top": ">= 3",
                      "ttft_p99_vconsole_over_transformers": "< 1"}}


async def _measure(endpoints: dict[str, str], api_url: str, levels: list[int], rounds: int,
                   prompt_len: int, output_len: int,
                   say: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    warm = LoadSpec(num=4, concurrency=4, prompt_len=(prompt_len, prompt_len),
                    output_len=(4, 4), seed=99)
    await _run(AsyncEngineClient(endpoints["input"], endpoints["output"]), warm)
    await _run(HttpLoadClient(api_url), warm)
    for c in levels:
        spec = LoadSpec(num=max(2 * c, 16), concurrency=c, prompt_len=(prompt_len, prompt_len),
                        output_len=(output_len, output_len), seed=c)
        runs: dict[str, list[dict[str, float]]] = {"native": [], "http": []}
        for r in range(rounds):
            order = ("native", "http") if r % 2 == 0 else ("http", "native")
            for how in order:
                client = (AsyncEngineClient(endpoints["input"], endpoints["output"])
                          if how == "native" else HttpLoadClient(api_url))
                runs[how].append(_figures(await _run(client, spec)))
                say(f"concurrency {c} round {r + 1} {how}: "
                    f"{runs[how][-1]['tok_per_s']:.0f} tok/s")
        native, http = _median(runs["native"]), _median(runs["http"])
        out[str(c)] = {
            "native": native, "http": http,
            "http_over_native": round(http["tok_per_s"] / native["tok_per_s"], 3),
            "itl_p99_http_over_native": round(http["itl_p99_s"] / native["itl_p99_s"], 3)
            if native["itl_p99_s"] else None,
            "num_requests": spec.num}
    return out
