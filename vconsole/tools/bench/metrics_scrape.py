"""`vconsole bench metrics`: what Prometheus's scrapes cost, and how long one takes.

Two parts, each on a real `vconsole engine` process (the tiny model) with ``--metrics-port``:

- **render**: an engine running one request (``--max-num-seqs 1``, a long generation) with
  ``waiting`` more queued behind it (10,000 by default). Once its /metrics says that many are
  waiting, ``scrapes`` GETs of /metrics, one after another, each timed from this process (HTTP
  included: an upper bound of the render). ``scrape_ms`` p50 / p99 / max, ``bytes``. The goal:
  p99 < 20 ms.
- **paired**: an engine decoding a full batch (``--max-num-seqs 64``, thousands of requests
  queued, 48 tokens each) while Debian's ``prometheus`` scrapes it every second; ``pairs``
  pairs of rounds of ``round_s``, Prometheus running in one and stopped (SIGSTOP) in the
  other, alternated in order. Tokens per second of a round: the engine's own
  ``vllm:generation_tokens_total`` read at the round's ends (one read each, in both modes).
  ``ratio_median``: the median of the pairs' scraped / unscraped ratios (the goal: ≥ 0.98);
  on a machine shared with other work the pairs scatter, and ``ratio_spread`` says how much.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.tools.bench.fleet import _pct

GOAL_SCRAPE_P99_MS = 20.0
GOAL_RATIO = 0.98


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


def family_sum(exposition: str, name: str) -> float:
    """The sum of the samples named ``name`` (every label set) in a text exposition; a longer
    name that starts with it (``..._by_reason``) is another family."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _sample(url: str, name: str) -> float:
    return family_sum(_get(url).decode(), name)


def _engine(args: list[str]) -> Any:
    from vconsole.engine.launch.engine_process import EngineProcess

    proc = EngineProcess(["--model", "tiny", "--metrics-port", "0", *args],
                         env={"HF_HUB_OFFLINE": "1"}).start(timeout_s=180)
    url = proc.ready.get("metrics")
    if not isinstance(url, str):
        proc.stop(grace_s=5)
        raise RuntimeError("the engine's ready file names no metrics URL")
    return proc, url if url.endswith("/metrics") else url.rstrip("/") + "/metrics"


def _fill(proc: Any, n: int, max_tokens: int) -> Any:
    from vconsole.engine.client.client import EngineClient

    client = EngineClient(proc.endpoints["input"], proc.endpoints["output"], timeout_s=30)
    for i in range(n):
        client.submit(prompt_token_ids=[5 + i % 200] * 8, max_tokens=max_tokens,
                      ignore_eos=True)
    return client


def render_part(waiting: int, scrapes: int, log: Callable[[str], None]) -> dict[str, Any]:
    proc, url = _engine(["--max-num-seqs", "1", "--num-kv-blocks", "512"])
    client = None
    try:
        log(f"render: queueing {waiting + 1} requests")
        client = _fill(proc, waiting + 1, 1000)
        deadline = time.monotonic() + 300
        while _sample(url, "vllm:num_requests_waiting") < waiting * 0.99:
            if time.monotonic() > deadline:
                raise RuntimeError("the engine never reported the queue")
            time.sleep(0.5)
        times, size = [], 0
        for _ in range(scrapes):
            t0 = time.perf_counter()
            size = len(_get(url))
            times.append((time.perf_counter() - t0) * 1000)
        p99 = _pct(times, 0.99)
        return {"waiting": int(_sample(url, "vllm:num_requests_waiting")), "scrapes": scrapes,
                "scrape_ms": {"p50": _pct(times, 0.5), "p99": p99, "max": max(times)},
                "bytes": size, "met": p99 is not None and p99 < GOAL_SCRAPE_P99_MS}
    finally:
        if client is not None:
            client.close()
        proc.stop(grace_s=10)


def paired_part(pairs: int, round_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("no prometheus: apt-get install prometheus")
    proc, url = _engine(["--max-num-seqs", "64", "--num-kv-blocks", "1024"])
    folder = Path(tempfile.mkdtemp(prefix="vconsole-bench-metrics-"))
    prom: subprocess.Popen[bytes] | None = None
    client = None
    try:
        target = url.split("//", 1)[1].split("/", 1)[0]
        cfg = folder / "prometheus.yml"
        cfg.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
            {"job_name": "engine", "static_configs": [{"targets": [target]}]}]}))
        with open(folder / "prometheus.log", "wb") as out:
            prom = subprocess.Popen([binary, f"--config.file={cfg}",
                                     f"--storage.tsdb.path={folder / 'tsdb'}",
                                     "--web.listen-address=127.0.0.1:0", "--log.level=warn"],
                                    stdout=out, stderr=subprocess.STDOUT)
        # More than it can finish: a quiet development machine decodes ~15,500 tok/s here.
        need = int(pairs * 2 * round_s * 30_000 / 48) + 2_000
        log(f"paired: queueing {need} requests, {pairs} pairs of {round_s:g} s")
        client = _fill(proc, need, 48)
        time.sleep(3.0)                                   # the batch full, Prometheus scraping
        rows = []
        for i in range(pairs):
            pair = {}
            for scraped in ((True, False) if i % 2 == 0 else (False, True)):
                os.kill(prom.pid, signal.SIGCONT if scraped else signal.SIGSTOP)
                t0, n0 = time.monotonic(), _sample(url, "vllm:generation_tokens_total")
                time.sleep(round_s)
                n1, t1 = _sample(url, "vllm:generation_tokens_total"), time.monotonic()
                pair["on" if scraped else "off"] = (n1 - n0) / (t1 - t0)
            rows.append(pair)
            log(f"pair {i + 1}: scraped {pair['on']:.0f} tok/s, not {pair['off']:.0f}")
        # A pair whose queue ran dry (either side under half the median round) measures the
        # drain, not the scrapes: left out, and counted.
        typical = statistics.median(v for p in rows for v in p.values())
        full = [p for p in rows if min(p.values()) >= 0.5 * typical > 0]
        ratios = sorted(p["on"] / p["off"] for p in full)
        median = round(statistics.median(ratios), 3) if ratios else None
        return {"pairs": [{k: round(v, 1) for k, v in p.items()} for p in rows],
                "ratio_median": median, "pairs_drained": len(rows) - len(full),
                "ratio_spread": [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None,
                "round_s": round_s, "scrape_interval_s": 1.0,
                "met": median is not None and median >= GOAL_RATIO}
    finally:
        if prom is not None:
            os.kill(prom.pid, signal.SIGCONT)
            prom.terminate()
            prom.wait(30)
        if client is not None:
            client.close()
        proc.stop(grace_s=10)
        shutil.rmtree(folder, ignore_errors=True)


def metrics_bench(waiting: int = 10_000, scrapes: int = 200, pairs: int = 8,
                  round_s: float = 5.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    render = render_part(waiting, scrapes, log)
    paired = paired_part(pairs, round_s, log) if pairs > 0 else None
    return {"benchmark": "metrics", "render": render, "paired": paired,
            "goal": {"scrape_p99_ms": GOAL_SCRAPE_P99_MS, "ratio_min": GOAL_RATIO},
            "met": bool(render["met"] and (paired is None or paired["met"])),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
