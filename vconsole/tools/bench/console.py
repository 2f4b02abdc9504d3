"""`vconsole bench console`: the console's lag behind the engine, and what watching costs it.

Engine side (this process): the real `Scheduler` and KV cache manager of `bench scheduler` —
256 running, the rest of ``num_requests`` (10,000) plus 10% waiting, model execution replaced by a token
per request and a 5 ms sleep (the forward's time, during which a real engine's CPU is the
device's) — drives a real `TelemetryPublisher` on 127.0.0.1 exactly as the engine process does
(in its publisher process: `vconsole.engine.publish.publisher_process`): `record_step` each
step, ``sched`` (a 10,000-row request table) and ``kv`` snapshots at 10 Hz.

Console side: a real console *process* (``python -m vconsole.tools.bench.console --child``): the
Textual app (`VConsoleApp`, headless through ``App.run_test``) on the Requests screen, its own
reader thread and data model. It notes, on the machine's one wall clock (``time.time``), when
each ``sched`` snapshot (its ``snapshot_ts``, stamped by the engine when it was taken) reached
the data model (`ConsoleState.ingest_message`) and when the screen's next refresh showed it
(`RequestsScreen.apply`, inside the app's batched refresh). ``p50_ms``/``p99_ms`` are the
snapshot-to-screen delays, ``model_p50_ms``/``model_p99_ms`` snapshot-to-model, and
``sent_p50_ms``/``sent_p99_ms`` snapshot to the publisher's send (the envelope's ``ts``).

CPU: the console process's CPU time (psutil, user + system, every thread) over wall time,
while the engine is busy (``busy_cpu_percent``) and then idle (``idle_cpu_percent``: no steps,
the publisher only re-sends its last state every heartbeat; measured from 1 s after the engine
went idle), each for ``seconds``.
``sort_filter_ms``: the slowest of a few filter + sort combinations over the 10,000 rows the
console holds (`vconsole.console.requests_view`), median of repeats, measured in the console.
Goals: p99 < 100 ms, idle < 5 % and busy < 25 % of a core, sort + filter within one refresh.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import zmq

from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import StepStats

GOAL_P99_MS = 100.0
GOAL_IDLE_CPU = 5.0
GOAL_BUSY_CPU = 25.0
REFRESH_HZ = 10.0
EXECUTE_S = 0.005
SORT_FILTERS = (("", "age_s", True), ("state:waiting", "priority", False),
                ("prio>0", "id", False), ("age>1", "num_prompt_tokens", True))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# --- the engine side ------------------------------------------------------------------------

class _Engine:
    """A scheduler with ``num_requests`` requests feeding a real publisher."""

    def __init__(self, num_requests: int) -> None:
        from vconsole.engine.publish.publisher import TelemetryPublisher
        from vconsole.engine.publish.request_rows import RequestRows
        from vconsole.tools.bench.scheduler import NUM_RUNNING, _Bench

        # 10% more requests than rows, so that the table stays full between the scheduler's
        # rebuilds of its cached waiting rows (`vconsole.engine.publish.request_rows`).
        self.bench = _Bench("priority", max(0, num_requests + num_requests // 10 - NUM_RUNNING))
        self.max_rows = num_requests
        self.rows = RequestRows()          # the request table, made on this side
        self.config = EngineConfig(telemetry_hz=REFRESH_HZ, telemetry_max_requests=num_requests)
        ctx: zmq.Context = zmq.Context.instance()
        # As the engine process runs it: in a publisher process (`publisher_process`).
        self.pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "bench-console", 0, self.config,
                                      process=True)
        self.pub.start()
        self.endpoint = self.pub.endpoint
        self.steps = 0
        self.sent_rows: list[int] = []     # rows of each request table submitted, in order

    def step(self) -> None:
        t0 = time.monotonic_ns()
        self.bench.step(record=False)
        time.sleep(EXECUTE_S)
        t1 = time.monotonic_ns()
        self.steps += 1
        self.pub.record_step(StepStats(schedule_ns=t1 - t0 - int(EXECUTE_S * 1e9),
                                       execute_ns=int(EXECUTE_S * 1e9), update_ns=0,
                                       total_ns=t1 - t0, num_prefill_tokens=0,
                                       num_decode_tokens=256, num_reqs=256))
        if self.pub.snapshot_due():
            sched = self.bench.sched
            stats = sched.stats(self.max_rows, self.rows)
            self.sent_rows.append(len(stats.requests))
            self.pub.submit_snapshot(stats, sched.kv_stats(), "running", self.steps)

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()

    def idle(self, seconds: float) -> None:
        self.pub.set_state("idle")
        time.sleep(seconds)

    def close(self) -> None:
        self.pub.close()


def console_bench(num_requests: int = 10_000, seconds: float = 4.0,
                  log: Any = None) -> dict[str, Any]:
    if log:
        log(f"engine side: {num_requests} requests ...")
    eng = _Engine(num_requests)
    child = subprocess.Popen([sys.executable, "-m", "vconsole.tools.bench.console", "--child",
                              eng.endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in child.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.strip() == "ready":
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.is_set():   # the console starts and shows the first snapshot
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the console process did not start")
            eng.step()
        eng.run(1.0)                 # settle
        proc = psutil.Process(child.pid)
        if log:
            log(f"busy for {seconds} s ...")
        c0, w0 = proc.cpu_times(), time.time()
        eng.run(seconds)
        c1b, w1 = proc.cpu_times(), time.time()
        if log:
            log(f"idle for {seconds} s ...")
        eng.idle(1.0)                # the console catches up with what it was sent
        c1, w1i = proc.cpu_times(), time.time()
        eng.idle(seconds)
        c2, w2 = proc.cpu_times(), time.time()
        child.stdin.write("stop\n")
        child.stdin.flush()
        child.wait(60)
        reader.join(5)
    finally:
        if child.poll() is None:
            child.kill()
        eng.close()
    report = json.loads(next(line for line in reversed(lines) if line.startswith("{")))

    def cpu(a: Any, b: Any, wall: float) -> float:
        return round(100 * ((b.user - a.user) + (b.system - a.system)) / wall, 1)

    # One delay per snapshot taken in the busy window: its first arrival (idle heartbeats
    # re-send old snapshots, which are not new data).
    screen = [1000 * (t - ts) for ts, t in report["screen"] if w0 <= ts <= w1]
    model = [1000 * (t - ts) for ts, t in report["model"] if w0 <= ts <= w1]
    sent = [1000 * (t - ts) for ts, t in report["sent"] if w0 <= ts <= w1]
    p99 = _percentile(screen, 99)
    busy, idle = cpu(c0, c1b, w1 - w0), cpu(c1, c2, w2 - w1i)
    sort_ms = report["sort_filter_ms"]
    return {
        "benchmark": "console", "num_requests": num_requests, "rows": report["rows"],
        # The tables the engine side sent last: the console's ``rows`` is one of them (the
        # scheduler's cached waiting rows lag admissions by up to a second, so fewer than
        # ``num_requests`` is the engine's table, not rows the console lost).
        "engine_rows_last": eng.sent_rows[-5:],
        "snapshots": len(screen), "refresh_hz": REFRESH_HZ,
        "p50_ms": _round(_percentile(screen, 50)), "p99_ms": _round(p99),
        "model_p50_ms": _round(_percentile(model, 50)),
        "model_p99_ms": _round(_percentile(model, 99)),
        "sent_p50_ms": _round(_percentile(sent, 50)), "sent_p99_ms": _round(_percentile(sent, 99)),
        "busy_cpu_percent": busy, "idle_cpu_percent": idle,
        "sort_filter_ms": sort_ms, "seconds": seconds,
        "goal": {"p99_ms_max": GOAL_P99_MS, "idle_cpu_max": GOAL_IDLE_CPU,
                 "busy_cpu_max": GOAL_BUSY_CPU, "sort_filter_ms_max": 1000 / REFRESH_HZ,
                 "p99_met": p99 is not None and p99 < GOAL_P99_MS,
                 "idle_met": idle < GOAL_IDLE_CPU, "busy_met": busy < GOAL_BUSY_CPU,
                 "sort_filter_met": sort_ms["max"] < 1000 / REFRESH_HZ},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --- the console side (a child process) -----------------------------------------------------

def sort_filter_ms(rows: Any, repeats: int = 5) -> dict[str, Any]:
    """Median ms of filter + sort (what the Requests screen runs: `requests_view.select` over
    the decoded columns) for each combination in ``SORT_FILTERS``, and the slowest."""
    from vconsole.console.requests_view import select
    from vconsole.telemetry.schema import RequestColumns

    cols = rows if isinstance(rows, RequestColumns) else RequestColumns.from_rows(list(rows))
    per = {}
    for query, key, reverse in SORT_FILTERS:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            select(cols, query, key, reverse)
            times.append(1000 * (time.perf_counter() - t0))
        per[f"{query or '-'} / {key}"] = round(statistics.median(times), 2)
    return {"max": max(per.values()), "by_case": per}


async def _watch(endpoint: str) -> dict[str, Any]:
    from vconsole.console.app import VConsoleApp
    from vconsole.console.screens.requests import RequestsScreen
    from vconsole.console.state import ConsoleState

    model: dict[float, float] = {}
    sent: dict[float, float] = {}
    screen: dict[float, float] = {}
    ingest, apply = ConsoleState.ingest_message, RequestsScreen.apply

    def timed_ingest(self: ConsoleState, msg: Any, recv_ts: float) -> None:
        ingest(self, msg, recv_ts)
        if msg.topic == "sched":
            model.setdefault(msg.payload.get("snapshot_ts"), time.time())
            sent.setdefault(msg.payload.get("snapshot_ts"), msg.ts)

    def timed_apply(self: RequestsScreen, frame: Any, state: ConsoleState) -> None:
        apply(self, frame, state)
        sc = frame.engine.latest.get("sched") if frame.engine else None
        if sc and sc.get("snapshot_ts") is not None:
            screen.setdefault(sc["snapshot_ts"], time.time())

    ConsoleState.ingest_message = timed_ingest  # type: ignore[method-assign]
    RequestsScreen.apply = timed_apply           # type: ignore[method-assign]
    stop = threading.Event()

    def stop_on_a_line() -> None:      # the parent writes a line when it has measured
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=stop_on_a_line, daemon=True).start()
    app = VConsoleApp([endpoint], refresh_hz=REFRESH_HZ)
    async with app.run_test(size=(120, 40)) as pilot:
        app.action_show("requests")
        while not screen:
            await pilot.pause(0.05)
        print("ready", flush=True)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        eng = app.state.engine()
        rows = (eng.latest.get("sched") or {}).get("requests") or [] if eng else []
        table = app.screen.query_one("#req-table")
        visible = table.scrollable_content_region.height
    return {"model": sorted(model.items()), "screen": sorted(screen.items()),
            "sent": sorted(sent.items()),
            "rows": len(rows), "visible_rows": visible, "sort_filter_ms": sort_filter_ms(rows)}


def _child(endpoint: str) -> None:
    print(json.dumps(asyncio.run(_watch(endpoint))), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        sys.exit("usage: python -m vconsole.tools.bench.console --child ENDPOINT "
                 "(run `vconsole bench console`)")
