"""`vconsole bench soak`: the demo's workload against a real engine for minutes, as JSON.

The engine runs as `vconsole demo` starts it (a supervised process, the demo's small pool of 128
KV blocks, 16 seats, the hybrid policy; ``--data-parallel-size 2`` for a 2-rank group) and the
load is the demo's (`vconsole.tools.loadgen.demo_spec`, `demo_rate`: bursts, quiet spells, long
prompts, shared prefixes, three priorities) through the real client. The pool is small on
purpose: bursts fill it and the scheduler preempts.

At the end the load stops sending, gives the requests in flight `DRAIN_S` to finish, aborts
the rest and waits for their final outputs (an abort's final output carries every token
sampled before it), then reads the engine's counters from its telemetry once it is idle. It
passes only with zero restarts, zero request errors (a request without its final output counts
as one; the aborts at the end do not), zero telemetry errors, preemptions seen, and the output
tokens the client received equal to the engine's ``num_generation_tokens_total`` (summed over
ranks); a run of `RSS_CHECK_MINUTES` or more must also keep the resident memory of the
engine's processes within 5% of what it was after the warm-up (a shorter run has no steady
state to compare with: the growth is reported, not judged). It also reports step times from
the ``step`` topic (each telemetry window's median step: their p50 and p99; and the longest
step seen).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import zmq

from vconsole.engine.launch.engine_process import EngineProcess, engine_env_beside_clients
from vconsole.telemetry import schema
from vconsole.tools.demo import DEMO_ENGINE_ARGS
from vconsole.tools.loadgen import LoadThread, demo_rate, demo_spec

WARMUP_SHARE = 0.2         # RSS is taken as the baseline after this share of the run
DRAIN_S = 20.0             # after the load stops sending: requests in flight may finish
ABORT_WAIT_S = 60.0        # then the rest are aborted: their final outputs must come
IDLE_TIMEOUT_S = 30.0      # then the engine's telemetry must show it idle with final counters
MAX_RSS_GROWTH = 0.05
RSS_CHECK_MINUTES = 5.0


class _Watcher(threading.Thread):
    """Keeps the last ``health`` and ``sched`` body of every rank and each window's step
    times, from a SUB socket of its own."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="soak-telemetry", daemon=True)
        self.endpoint = endpoint
        self.lock = threading.Lock()
        self.health: dict[int, dict[str, Any]] = {}
        self.sched: dict[int, dict[str, Any]] = {}
        self.step_p50: list[float] = []
        self.step_max = 0.0
        self.restart_alerts = 0
        self.telemetry_error_alerts = 0
        self._halt = threading.Event()

    def run(self) -> None:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            while not self._halt.is_set():
                if sock.poll(100):
                    self._take(schema.decode(sock.recv_multipart()))
        finally:
            sock.close(0)

    def _take(self, msg: schema.TelemetryMessage) -> None:
        p = msg.payload
        with self.lock:
            if msg.topic == "health":
                self.health[msg.rank] = p
            elif msg.topic == "sched":
                self.sched[msg.rank] = p
            elif msg.topic == "step" and p.get("steps"):
                self.step_p50.append(float(p["step_time_p50_s"]))
                self.step_max = max(self.step_max, float(p["step_time_max_s"]))
            elif msg.topic == "alert" and p.get("name") == "engine_restart":
                self.restart_alerts += 1
            elif msg.topic == "alert" and p.get("name") == "telemetry_error":
                self.telemetry_error_alerts += 1

    def total(self, key: str, body: str = "sched") -> int:
        with self.lock:
            bodies = self.sched if body == "sched" else self.health
            return sum(int(b.get(key) or 0) for b in bodies.values())

    def idle(self, ranks: int) -> bool:
        with self.lock:
            return len(self.sched) >= ranks and all(
                b["num_running"] == 0 and b["num_waiting"] == 0 for b in self.sched.values())

    def close(self) -> None:
        self._halt.set()
        self.join(5)


def _tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and every process below it (supervisors, ranks)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def soak_bench(minutes: float, *, data_parallel_size: int = 1, rate: float = 8.0,
               seed: int = 0, log: Callable[[str], None] | None = None,
               data_parallel_backend: str = "mp") -> dict[str, Any]:
    """Run the soak (see the module docstring) and return its JSON report.
    ``data_parallel_backend`` ``ray``: the ranks are Ray actors on a local Ray the engine
    starts (their memory is then not in ``rss_*``: they are Ray's children, not the
    engine's)."""
    say = log or (lambda _m: None)
    duration = minutes * 60.0
    engine_args = list(DEMO_ENGINE_ARGS)
    if data_parallel_size > 1:
        engine_args += ["--data-parallel-size", str(data_parallel_size)]
        if data_parallel_backend != "mp":
            engine_args += ["--data-parallel-backend", data_parallel_backend]
    engine = EngineProcess(engine_args, env=engine_env_beside_clients(data_parallel_size))
    say(f"soak: starting the engine ({' '.join(engine_args)})")
    engine.start(timeout_s=300)
    watcher = _Watcher(engine.endpoints["telemetry"])
    watcher.start()
    sending = threading.Event()
    sending.set()
    base_rate = demo_rate(rate)
    load = LoadThread(engine.endpoints["input"], engine.endpoints["output"], demo_spec(seed),
                      rate_fn=lambda t: base_rate(t) if sending.is_set() else 0.0,
                      timeout_s=30.0, abort_wait_s=ABORT_WAIT_S)
    load_errors: list[str] = []
    load.on_error = load_errors.append
    pid = engine.pid or 0
    rss_warm = rss_end = 0
    t0 = time.monotonic()
    idle = False
    try:
        load.start()
        next_log = t0 + 30
        while (now := time.monotonic()) - t0 < duration:
            if not rss_warm and now - t0 >= WARMUP_SHARE * duration:
                rss_warm = _tree_rss(pid)
            if now >= next_log:
                run = load.run_state
                say(f"soak: {now - t0:.0f}/{duration:.0f} s, {run.done} requests done, "
                    f"{run.tokens} tokens, {engine.read_restarts()} restarts")
                next_log = now + 30
            time.sleep(0.5)
        sending.clear()
        say(f"soak: load stopped sending; {load.run_state.in_flight} requests in flight")
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline and load.run_state.in_flight > 0:
            time.sleep(0.2)
        load.stop(ABORT_WAIT_S + 10)        # aborts the rest, waits for their final outputs
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            idle = watcher.idle(data_parallel_size) and \
                watcher.total("num_generation_tokens_total") == load.run_state.tokens
            if idle:
                break
            time.sleep(0.2)
        idle = idle or watcher.idle(data_parallel_size)
        rss_end = _tree_rss(pid)
    finally:
        load.stop()
        restarts = engine.read_restarts()
        engine.stop()
        watcher.close()

    summary = load.run_state.summary()
    # Failures by kind, as `vconsole load` counts them: the aborts of the load's own stop are
    # not among them; a request without its final output is (``no_final_output``).
    errors = dict(summary["errors"])
    aborted = summary["aborted"]
    request_errors = sum(errors.values()) + len(load_errors)
    tokens_engine = watcher.total("num_generation_tokens_total")
    telemetry_errors = watcher.total("telemetry_errors", body="health")
    preemptions = watcher.total("num_preemptions_total")
    p50s = np.asarray(watcher.step_p50 or [0.0])
    growth = (rss_end / rss_warm - 1.0) if rss_warm else None
    checks = {
        "no_restarts": restarts == 0 and watcher.restart_alerts == 0,
        "no_request_errors": request_errors == 0,
        "no_telemetry_errors": telemetry_errors == 0,
        "engine_idle_at_end": idle,
        "tokens_equal_counters": tokens_engine == summary["output_tokens"],
        "preemptions_seen": preemptions > 0,
    }
    if minutes >= RSS_CHECK_MINUTES:
        checks["rss_growth_under_5pct"] = growth is not None and growth < MAX_RSS_GROWTH
    return {
        "bench": "soak",
        "minutes": minutes,
        "data_parallel_size": data_parallel_size,
        "data_parallel_backend": data_parallel_backend if data_parallel_size > 1 else None,
        "engine_args": engine_args,
        "rate": rate,
        "passed": all(checks.values()),
        "checks": checks,
        "restarts": restarts,
        "restart_reason": engine.restart_reason,
        "request_errors": request_errors,
        "errors": errors,
        "error_examples": summary["error_examples"],
        "load_errors": load_errors[-5:],
        "telemetry_errors": telemetry_errors,
        "requests": summary["requests"],
        "completed": summary["completed"],
        "aborted_at_end": aborted,
        "preemptions": preemptions,
        "tokens_received": summary["output_tokens"],
        "tokens_engine": tokens_engine,
        "rss_warm_bytes": rss_warm,
        "rss_end_bytes": rss_end,
        "rss_growth": None if growth is None else round(growth, 4),
        "step_time_s": {"window_p50_p50": float(np.percentile(p50s, 50)),
                        "window_p50_p99": float(np.percentile(p50s, 99)),
                        "max": watcher.step_max},
        "ttft_s": summary["ttft_s"],
        "tok_per_s": round(summary["tok_per_s"], 1),
        "log": str(engine.log_path) if engine.failed else None,
    }
