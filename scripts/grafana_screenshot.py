"""screenshots/grafana-dashboard.png: examples/grafana/vconsole.json drawn from live data.

    .venv/bin/python scripts/grafana_screenshot.py [--duration 240] [--out screenshots/...]

Starts what an operator runs: an engine with two data-parallel ranks (the tiny model, a small
KV pool so requests are preempted, vLLM's opt-in ``--kv-cache-metrics`` and
``--enable-mfu-metrics``), `vconsole serve` in front of it, and Debian's ``prometheus`` scraping
the server every 5 s; sends requests with the openai SDK for ``--duration`` seconds in three
waves of rising concurrency (shared prompt prefixes, varied lengths and ``n``, a few streams
the client walks away from); then `vconsole.tools.dashboard_preview` runs every panel's query
against that Prometheus over the run and draws the page, and headless Chromium screenshots it:
the whole page, and its first two rows (latency, throughput) as ...-top.png for the README.

It is a preview by our own renderer, not Grafana (no Grafana server is packaged by the
registries this project installs from); the page says so. Everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from vconsole.engine.launch.child import ChildProcess
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.tools.dashboard_model import layout
from vconsole.tools.dashboard_preview import fetch, render_html, screenshot

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "grafana" / "vconsole.json"
SCRAPE_S = 5.0
ENGINE_ARGS = ["--model", "tiny", "--data-parallel-size", "2", "--num-kv-blocks", "48",
               "--block-size", "8", "--max-num-seqs", "8", "--metrics-port", "0",
               "--kv-cache-metrics", "--kv-cache-metrics-sample", "0.25",
               "--enable-mfu-metrics", "--set", "heartbeat_interval_s=0.5"]
TOP_ROWS = 34                                     # the README's crop: latency and throughput
PREFIXES = [[3 + k] * 24 for k in range(4)]       # shared prompt starts: prefix-cache hits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(cond, what: str, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {what}")
        time.sleep(0.25)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def start_prometheus(folder: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("no prometheus: apt-get install prometheus")
    port = free_port()
    cfg = folder / "prometheus.yml"
    cfg.write_text(json.dumps({
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
        "scrape_configs": [{"job_name": "vconsole",
                            "static_configs": [{"targets": [target]}]}]}))
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([binary, f"--config.file={cfg}",
                             f"--storage.tsdb.path={folder / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait(lambda: http_ok(f"{url}/-/ready"), "prometheus ready")
    return proc, url


def client_loop(port: int, stop_at: float, seed: int, counts: dict[str, int],
                lock: threading.Lock) -> None:
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           timeout=120)
    while time.time() < stop_at:
        prompt = rng.choice(PREFIXES) + [rng.randrange(5, 250) for _ in range(rng.randrange(4,
                                                                                          40))]
        max_tokens = rng.choice((8, 16, 24, 32, 48))
        try:
            if rng.random() < 0.08:              # a client that walks away: an abort
                stream = client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                   max_tokens=64, extra_body={"ignore_eos": True})
                for i, _ in enumerate(stream):
                    if i >= 2:
                        break
                stream.close()
                outcome = "walked away"
            else:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                          n=rng.choice((1, 1, 1, 2)), temperature=0.8,
                                          extra_body={"ignore_eos": rng.random() < 0.9})
                outcome = "done"
        except openai.APIError as e:
            outcome = type(e).__name__
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1


def drive(port: int, duration_s: float) -> dict[str, int]:
    """Three waves: 2, then 8, then 20 clients."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    end = time.time() + duration_s
    threads: list[threading.Thread] = []
    for wave, clients in enumerate((2, 8, 20)):
        for k in range(clients - len(threads)):
            t = threading.Thread(target=client_loop, args=(port, end, 100 * wave + k, counts,
                                                           lock), daemon=True)
            t.start()
            threads.append(t)
        print(f"wave {wave + 1}: {clients} clients", flush=True)
        time.sleep(min(duration_s / 3, max(0.0, end - time.time())))
    for t in threads:
        t.join(180)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=240.0, help="seconds of load (240)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--out", type=Path, default=ROOT / "screenshots" / "grafana-dashboard.png")
    p.add_argument("--html", type=Path, help="keep the rendered page here too")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="vconsole-grafana-"))
    engine = EngineProcess(ENGINE_ARGS, log_path=folder / "engine.log")
    serve: ChildProcess | None = None
    prom: subprocess.Popen[bytes] | None = None
    try:
        engine.start(timeout_s=300)
        port = free_port()
        with open(folder / "serve.log", "wb") as out:
            serve = ChildProcess([sys.executable, "-m", "vconsole", "serve", "--port", str(port),
                                  "--engine-ready-file", str(engine.ready_path)],
                                 stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wait(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "vconsole serve healthy")
        prom, url = start_prometheus(folder, f"127.0.0.1:{port}")
        time.sleep(2 * SCRAPE_S)                  # scrapes before the first request: zeros
        start = time.time()
        counts = drive(port, args.duration)
        time.sleep(3 * SCRAPE_S)                  # the idle tail, scraped
        end = time.time()
        print(f"requests: {counts}", flush=True)
        model = json.loads(DASHBOARD.read_text())
        pre = fetch(model, url, start - 2 * SCRAPE_S, end, scrape_interval_s=SCRAPE_S,
                    width=args.width)
        page = args.html or folder / "dashboard.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render_html(pre))
        empty = [v.title for v in pre.panels if v.type != "row"
                 and not any(s.finite() for r in v.results for s in r.series)]
        failed = [(v.title, r.error) for v in pre.panels for r in v.results if r.error]
        print(f"{len(pre.panels)} panels; no data: {empty or 'none'}; errors: "
              f"{failed or 'none'}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(page, args.out, pre.width, pre.height)
        top = args.out.with_name(args.out.stem + "-top" + args.out.suffix)
        top_px = layout({"y": TOP_ROWS, "h": 0}, pre.width).top       # the first two rows
        screenshot(page, top, pre.width, top_px)
        print(f"wrote {args.out} ({pre.width}x{pre.height}) and {top} ({pre.width}x{top_px})")
        return 1 if failed else 0
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        if serve is not None:
            serve.stop(30, signal.SIGINT)
        engine.stop(grace_s=30)
        shutil.rmtree(folder / "tsdb", ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
