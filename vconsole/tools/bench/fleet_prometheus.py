"""`vconsole bench fleet --prometheus`: the console's Prometheus source (`attach --prometheus`)
on a fleet of ``--targets`` instances, each refresh timed.

The fleet: HTTP stand-ins of vLLM, SGLang and llama.cpp in turn (`fleet_standins`, each
kind's own metric names and vLLM's bucket bounds, figures moving every second) plus
``--engines`` of ours (``vconsole engine --metrics-port``, tiny model); Debian's
``prometheus`` scrapes every one of them every ``scrape_s`` (a generated config, its TSDB in a
temporary folder). Once Prometheus has scraped all of them twice, this process does what the
console's reader thread and Fleet screen do every ``interval_s`` (2 s, the source's own):
`PrometheusSource.read_once` (every PromQL query of a read, at one evaluation time: the
inventory, ``up``, the gauges, the rates, each row's and the fleet's ``histogram_quantile``
over ``sum by (le)``) and the rows and fleet row built from it
(`PrometheusFleet.rows` / `aggregate`). Measured:

- ``refresh_ms``: p50 / p99 / max of one refresh, PromQL included (the goal: p99 < 300 ms);
- ``rows``: rows in the last refresh (every instance, each rank of ours its own row);
- ``cpu_share`` of this process and ``prometheus_cpu_share`` of Prometheus, of one core.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.console.sources.fleet.prometheus_query import PrometheusSource
from vconsole.console.sources.fleet.prometheus_rows import PrometheusFleet
from vconsole.tools.bench.fleet import KINDS, _pct, _standins, free_ports

GOAL_P99_MS = 300.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?"
                                f"{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        return list(json.load(r)["data"]["result"])


def prometheus_fleet_bench(targets: int = 64, engines: int = 2, seconds: float = 60.0,
                           base_port: int = 42200, scrape_s: float = 2.0,
                           interval_s: float = 2.0,
                           log: Callable[[str], None] = print) -> dict[str, Any]:
    from vconsole.engine.launch.engine_process import EngineProcess, loopback_endpoints

    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("no prometheus: apt-get install prometheus")
    n_http = max(1, targets - engines)
    ports = free_ports(n_http + engines + 1, base_port, base_port + 590)
    specs = [f"{KINDS[i % 3]}:{port}" for i, port in enumerate(ports[:n_http])]
    metric_ports, prom_port = ports[n_http:n_http + engines], ports[-1]
    folder = Path(tempfile.mkdtemp(prefix="vconsole-bench-prometheus-"))
    log(f"prometheus fleet bench: {n_http} stand-ins, {engines} engines of ours, scraped every "
        f"{scrape_s:g} s, {seconds:g} s measured")
    standins = _standins(specs)
    procs: list[EngineProcess] = []
    prom: subprocess.Popen[bytes] | None = None
    try:
        for i, mport in enumerate(metric_ports):
            p = EngineProcess(["--model", "tiny", "--num-kv-blocks", "64",
                               "--metrics-port", str(mport)],
                              endpoints=loopback_endpoints(base_port + 600 + 10 * i),
                              env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
            procs.append(p.start(timeout_s=180))
        scraped = [f"127.0.0.1:{s.split(':')[1]}" for s in specs] + \
            [f"127.0.0.1:{p}" for p in metric_ports]
        cfg = folder / "prometheus.yml"
        cfg.write_text(json.dumps({"global": {"scrape_interval": f"{scrape_s:g}s"},
                                   "scrape_configs": [{"job_name": "fleet", "static_configs":
                                                       [{"targets": scraped}]}]}))
        url = f"http://127.0.0.1:{prom_port}"
        with open(folder / "prometheus.log", "wb") as out:
            prom = subprocess.Popen([binary, f"--config.file={cfg}",
                                     f"--storage.tsdb.path={folder / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}",
                                     "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:                       # every target up, then two more scrapes for rates
            try:
                up = _query(url, "count(up == 1)")
                if up and int(float(up[0]["value"][1])) == len(scraped):
                    break
            # Not up yet. Before Prometheus listens, a connection to a port in the ephemeral
            # range can meet itself (TCP self-connect) and read its own request back.
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus never scraped all {len(scraped)} targets; "
                                   f"log: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(2 * scrape_s + 1)
        return _measure(url, prom.pid, seconds, interval_s) | {
            "benchmark": "fleet-prometheus", "targets": len(scraped), "engines": engines,
            "stand_ins": n_http, "scrape_s": scrape_s, "interval_s": interval_s,
            "goal": {"refresh_p99_ms": GOAL_P99_MS},
            "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}}
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        if standins.poll() is None:
            standins.kill()
        standins.wait()
        for p in procs:
            p.stop(grace_s=5)
        shutil.rmtree(folder, ignore_errors=True)


def _measure(url: str, prom_pid: int, seconds: float, interval_s: float) -> dict[str, Any]:
    source = PrometheusSource(url, interval_s=interval_s)
    fleet = PrometheusFleet(source, started=time.time())
    refresh: list[float] = []
    failed = 0
    rows = 0
    cpu0, prom0, wall0 = time.process_time(), _cpu_s(prom_pid), time.monotonic()
    while time.monotonic() - wall0 < seconds:
        t0 = time.perf_counter()
        ok = source.read_once()
        now = time.time()
        got = fleet.rows(None, now)
        fleet.aggregate(got)
        refresh.append((time.perf_counter() - t0) * 1000)
        failed += not ok
        rows = len(got)
        time.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))
    wall = time.monotonic() - wall0
    p99 = _pct(refresh, 0.99)
    return {"refresh_ms": {"p50": _pct(refresh, 0.5), "p99": p99, "max": max(refresh),
                           "n": len(refresh)},
            "failed_reads": failed, "problem": source.problem, "rows": rows,
            "cpu_share": (time.process_time() - cpu0) / wall,
            "prometheus_cpu_share": (_cpu_s(prom_pid) - prom0) / wall,
            "met": p99 is not None and p99 < GOAL_P99_MS and failed == 0}
