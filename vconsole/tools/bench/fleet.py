"""`vconsole bench fleet`: the fleet console's cost and truth at scale.

``--targets N`` live targets: ``--engines`` of ours (``vconsole engine`` processes, tiny model)
and the rest HTTP stand-ins of vLLM, SGLang and llama.cpp in turn, served by a process of their
own (`vconsole.tools.bench.fleet_standins`: each kind's own metric names). This process runs
what the console runs: one source per target (`vconsole.console.sources.fleet`), and at 10 Hz
the Fleet screen's refresh without Textual (every row, the fleet's row, the findings, every
cell's text). Measured:

- ``refresh_ms``: p50 / p99 / max of one refresh (the goal: p99 < 100 ms);
- ``cpu_share``: this process's CPU time over the wall time, of one core (goal < 15%);
- ``row_gap_s``: per target, the longest time between two new readings, p50 / max over the
  targets (every row refreshed at least once a second: max ≤ about 1 s plus a read);
- ``killed_down_after_s``: halfway, one stand-in process (holding one target) is killed: how
  long until its row is ``down`` (goal < 5 s), and ``row_gap_s_during_kill`` of the others.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from vconsole.console.sources.fleet.imbalance import findings
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.fleet.snapshot import FleetWatch, build_sources
from vconsole.console.sources.fleet.targets import Target, make_target
from vconsole.console.sources.fleet.view import cells

KINDS = ("vllm", "sglang", "llama-cpp")
REFRESH_HZ = 10.0


def _standins(specs: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "vconsole.tools.bench.fleet_standins",
                             *specs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the stand-ins did not start")
    return proc


def free_ports(n: int, start: int, stop: int) -> list[int]:
    """``n`` ports from ``start`` that can be listened on now: a port can be a client's
    ephemeral port (in TIME_WAIT for a minute) on a busy machine."""
    out: list[int] = []
    for port in range(start, stop):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError(f"not {n} free ports in {start}-{stop - 1}")


def _pct(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile: the smallest value with at least ``q`` of them at or
    below it (p99 of 100 values is the 99th, not the largest)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def fleet_bench(targets: int = 64, engines: int = 2, seconds: float = 20.0,
                base_port: int = 42200, log: Callable[[str], None] = print) -> dict[str, Any]:
    from vconsole.engine.launch.engine_process import EngineProcess, loopback_endpoints

    n_http = max(1, targets - engines)
    specs = [f"{KINDS[i % 3]}:{port}"
             for i, port in enumerate(free_ports(n_http, base_port, base_port + 590))]
    victim = specs[-1]
    procs: list[EngineProcess] = []
    ts: list[Target] = []
    log(f"fleet bench: {n_http} stand-ins, {engines} engines of ours, {seconds:g} s")
    standins = _standins(specs[:-1])
    lone = _standins([victim])
    try:
        for i in range(engines):
            base = base_port + 600 + 10 * i
            p = EngineProcess(["--model", "tiny", "--num-kv-blocks", "64"],
                              endpoints=loopback_endpoints(base),
                              env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
            procs.append(p.start(timeout_s=180))
            ts.append(make_target("vconsole", f"127.0.0.1:{base}", name=f"ours-{i}"))
        ts += [make_target(s.split(":")[0], f"127.0.0.1:{s.split(':')[1]}",
                           name=f"{s.split(':')[0]}-{i}") for i, s in enumerate(specs)]
        sources, problems = build_sources(ts)
        watch = FleetWatch(sources).start()
        try:
            return _measure(watch, ts[-1].name, lone, seconds, log) | {
                "targets": len(ts), "engines": engines, "stand_ins": n_http,
                "problems": problems, "machine": {"cpus": os.cpu_count(),
                                                  "load_avg": os.getloadavg()}}
        finally:
            watch.stop()
    finally:
        for proc in (standins, lone):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for p in procs:
            p.stop(grace_s=5)


def _measure(watch: FleetWatch, victim: str, lone: subprocess.Popen[str], seconds: float,
             log: Callable[[str], None]) -> dict[str, Any]:
    time.sleep(3.0)                                  # every target read twice
    refresh: list[float] = []
    seen: dict[str, float] = {}
    gaps: dict[str, float] = {}
    gaps_kill: dict[str, float] = {}
    killed_at: float | None = None
    down_after: float | None = None
    cpu0, wall0 = time.process_time(), time.monotonic()
    end = wall0 + seconds
    while (now := time.monotonic()) < end:
        t0 = time.perf_counter()
        rows = watch.rows()
        Fleet.aggregate(rows)
        findings(rows, time.time())
        for r in rows:
            cells(r, time.time())
        refresh.append((time.perf_counter() - t0) * 1000)
        with watch.state.lock:
            for r in rows:
                eng = watch.state.engines.get(r.engine_key or "")
                t = eng.last_heartbeat if eng is not None else None
                if t is None or r.name == victim:
                    continue
                if r.name in seen and t > seen[r.name]:
                    gap = t - seen[r.name]
                    gaps[r.name] = max(gaps.get(r.name, 0.0), gap)
                    if killed_at is not None:
                        gaps_kill[r.name] = max(gaps_kill.get(r.name, 0.0), gap)
                seen[r.name] = t
        if killed_at is None and now - wall0 >= seconds / 2:
            lone.kill()
            killed_at = now
            log(f"killed the stand-in of {victim}")
        if killed_at is not None and down_after is None and \
                any(r.name == victim and r.state == "down" for r in rows):
            down_after = now - killed_at
        time.sleep(max(0.0, 1 / REFRESH_HZ - (time.perf_counter() - t0)))
    wall = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    while killed_at is not None and down_after is None and \
            time.monotonic() - killed_at < 15.0:        # the run ended first: keep watching it
        if any(r.name == victim and r.state == "down" for r in watch.rows()):
            down_after = time.monotonic() - killed_at
        time.sleep(0.05)
    return {
        "refresh_ms": {"p50": _pct(refresh, 0.5), "p99": _pct(refresh, 0.99),
                       "max": max(refresh), "n": len(refresh)},
        "cpu_share": cpu / wall,
        "row_gap_s": {"p50": statistics.median(gaps.values()) if gaps else None,
                      "max": max(gaps.values(), default=None)},
        "row_gap_s_during_kill": {"max": max(gaps_kill.values(), default=None)},
        "killed_down_after_s": down_after,
        "goals": {"refresh_p99_ms": 100, "cpu_share": 0.15, "row_gap_max_s": 1.0,
                  "killed_down_s": 5.0},
    }
