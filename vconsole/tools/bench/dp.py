"""`vconsole bench dp`: throughput of 2 data-parallel ranks against 1 engine, and the coordination
overhead per step.

Three real engines run side by side for the whole benchmark, all with the tiny model and the
same flags: a lone engine (every core for its intra-op threads), the same with one thread
(``OMP_NUM_THREADS=1``) and a 2-rank group (``--data-parallel-size 2``: launcher, front end, two
ranks with ``cores / 2`` threads each, `vconsole.engine.dp.launcher.rank_env`). Each round
sends the same burst (fixed prompts, greedy, ``ignore_eos``) to each in turn, rotating which goes
first, through one `EngineClient`; a round's figure is output tokens / seconds from the first
submit to the last final output. Reported: the medians, ``ratio`` = 2 ranks / lone engine,
``ratio_vs_one_thread`` = 2 ranks / the one-thread engine, and every round's figure (the spread
says how far to trust them). With the tiny model a step is mostly Python (scheduling, sampling,
I/O) that one process runs on one core, so two ranks can beat one engine even on shared cores,
and a lone engine's threads suffer most from other load on the machine; with a real model on
one device per rank the ratio is what data parallelism buys.

``--data-parallel-backend ray`` compares backends instead (`backends_bench`): the same 2-rank
group as processes and as Ray actors, start-up seconds and tokens/s.

The overhead comes from the group's own ``dp`` telemetry over the measured rounds (its
counters' growth, summed over ranks): ``sync_s_per_step`` = all-reduce seconds / steps (real
and dummy), ``dummy_share`` = dummy steps / steps, ``syncs_per_step``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry import schema
from vconsole.telemetry.listener import TelemetryListener

ENGINE_ARGS = ["--num-kv-blocks", "256", "--block-size", "16", "--max-num-seqs", "32"]
COUNTERS = ("steps_total", "dummy_steps_total", "sync_count_total", "sync_s_total")


def _round(endpoints: dict[str, str], work: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second of one burst."""
    with EngineClient(endpoints["input"], endpoints["output"], timeout_s=60) as client:
        t0 = time.perf_counter()
        ids = [client.submit(prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True)
               for ids in work]
        done = client.gather(ids, timeout_s=600)
        elapsed = time.perf_counter() - t0
    tokens = sum(len(c.output_token_ids) for c in done.values())
    bad = [c.finish_reason for c in done.values() if c.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"benchmark requests did not finish normally: {bad[:3]}")
    return tokens / elapsed


class DPCounters:
    """Each rank's latest ``dp`` counters, from a SUB thread on the group's telemetry."""

    def __init__(self, endpoint: str) -> None:
        self.latest: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on_message, topics=("dp",))

    def _on_message(self, msg: schema.TelemetryMessage) -> None:
        if msg.topic == "dp":
            with self._lock:
                self.latest[msg.rank] = {k: float(msg.payload.get(k) or 0.0) for k in COUNTERS}

    def snapshot(self) -> dict[int, dict[str, float]]:
        with self._lock:
            return {r: dict(c) for r, c in self.latest.items()}

    def close(self) -> None:
        self._listener.close(None)


def _started(args: list[str], say: Callable[[str], None], name: str) -> tuple[EngineProcess,
                                                                                 float]:
    """An engine started now, and its start-up seconds (launch to ready file)."""
    t0 = time.perf_counter()
    engine = EngineProcess(args).start(timeout_s=600)
    elapsed = time.perf_counter() - t0
    say(f"{name}: ready in {elapsed:.1f} s")
    return engine, elapsed


def backends_bench(num_requests: int = 32, rounds: int = 3, max_tokens: int = 32,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`vconsole bench dp --data-parallel-backend ray`: a 2-rank group of processes (``mp``)
    against the same group of Ray actors (``ray``, on a local Ray it starts): start-up time
    (launch to ready, one after the other, the Ray one including starting Ray) and tokens/s
    of the same bursts, in alternating order."""
    say = log or (lambda _m: None)
    work = [[(7 * i + j) % 250 + 3 for j in range(24)] for i in range(num_requests)]
    two = [*ENGINE_ARGS, "--data-parallel-size", "2"]
    mp, mp_s = _started(two, say, "mp")
    try:
        ray, ray_s = _started([*two, "--data-parallel-backend", "ray"], say, "ray")
        try:
            peers = {"mp": mp, "ray": ray}
            for engine in peers.values():       # warm-up: first forwards, connections
                _round(engine.endpoints, work[:4], 4)
            tps: dict[str, list[float]] = {n: [] for n in peers}
            for i in range(rounds):
                for n in (["mp", "ray"] if i % 2 == 0 else ["ray", "mp"]):
                    tps[n].append(_round(peers[n].endpoints, work, max_tokens))
                    say(f"round {i + 1}: {n} {tps[n][-1]:.1f} tokens/s")
        finally:
            t0 = time.perf_counter()
            ray.stop(grace_s=60)
            ray_stop_s = time.perf_counter() - t0
    finally:
        t0 = time.perf_counter()
        mp.stop(grace_s=60)
        mp_stop_s = time.perf_counter() - t0
    a, b = statistics.median(tps["mp"]), statistics.median(tps["ray"])
    return {
        "bench": "dp-backends", "data_parallel_size": 2,
        "startup_s_mp": round(mp_s, 2), "startup_s_ray": round(ray_s, 2),
        "stop_s_mp": round(mp_stop_s, 2), "stop_s_ray": round(ray_stop_s, 2),
        "tokens_per_s_mp": round(a, 1), "tokens_per_s_ray": round(b, 1),
        "ratio_ray_vs_mp": round(b / a, 3) if a else None,
        "tokens_per_s_mp_rounds": [round(x, 1) for x in tps["mp"]],
        "tokens_per_s_ray_rounds": [round(x, 1) for x in tps["ray"]],
        "rounds": rounds, "num_requests": num_requests, "max_tokens": max_tokens,
    }


def dp_bench(num_requests: int = 32, rounds: int = 3, max_tokens: int = 32,
             log: Callable[[str], None] | None = None, backend: str = "mp") -> dict[str, Any]:
    """The bench (module docstring); ``backend`` ``ray``: `backends_bench` instead."""
    if backend == "ray":
        return backends_bench(num_requests, rounds, max_tokens, log)
    say = log or (lambda _m: None)
    work = [[(7 * i + j) % 250 + 3 for j in range(24)] for i in range(num_requests)]
    say("starting a lone engine and a 2-rank group (tiny model)...")
    with EngineProcess([*ENGINE_ARGS]) as one, \
            EngineProcess([*ENGINE_ARGS], env={"OMP_NUM_THREADS": "1"}) as one_t1, \
            EngineProcess([*ENGINE_ARGS, "--data-parallel-size", "2"]) as two:
        peers = {"1": one, "1t1": one_t1, "2": two}
        telemetry = DPCounters(two.endpoints["telemetry"])
        try:
            for engine in peers.values():       # warm-up: first forwards, connections
                _round(engine.endpoints, work[:4], 4)
            time.sleep(1.0)
            before = telemetry.snapshot()
            tps: dict[str, list[float]] = {n: [] for n in peers}
            names = list(peers)
            for i in range(rounds):
                for n in names[i % 3:] + names[:i % 3]:       # each peer first in turn
                    tps[n].append(_round(peers[n].endpoints, work, max_tokens))
                    say(f"round {i + 1}: {n} {tps[n][-1]:.1f} tokens/s")
            time.sleep(1.0)    # the ranks' next dp snapshot after the last wave
            after = telemetry.snapshot()
        finally:
            telemetry.close()
    grown = {k: sum(after.get(r, {}).get(k, 0.0) - before.get(r, {}).get(k, 0.0)
                    for r in after) for k in COUNTERS}
    steps = grown["steps_total"]
    a, a1, b = (statistics.median(tps[n]) for n in ("1", "1t1", "2"))
    return {
        "tokens_per_s_1": round(a, 1), "tokens_per_s_2": round(b, 1),
        "ratio": round(b / a, 3) if a else None,
        "tokens_per_s_1_one_thread": round(a1, 1),
        "ratio_vs_one_thread": round(b / a1, 3) if a1 else None,
        "sync_s_per_step": grown["sync_s_total"] / steps if steps else None,
        "syncs_per_step": grown["sync_count_total"] / steps if steps else None,
        "dummy_share": grown["dummy_steps_total"] / steps if steps else None,
        "steps": int(steps), "dummy_steps": int(grown["dummy_steps_total"]),
        "tokens_per_s_1_rounds": [round(x, 1) for x in tps["1"]],
        "tokens_per_s_1_one_thread_rounds": [round(x, 1) for x in tps["1t1"]],
        "tokens_per_s_2_rounds": [round(x, 1) for x in tps["2"]],
        "threads_1": os.cpu_count(), "threads_per_rank": max(1, (os.cpu_count() or 1) // 2),
        "rounds": rounds, "num_requests": num_requests, "max_tokens": max_tokens,
        "ranks_reporting": sorted(after),
    }
