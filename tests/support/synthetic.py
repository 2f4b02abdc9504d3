"""A synthetic telemetry stream: realistic-looking payloads from a toy model of an engine.

For the console's tests, snapshots and screenshots where no engine runs. The toy engine admits
Poisson arrivals with a priority mix, runs up to ``max_num_seqs`` of them, grows their KV blocks
one token per step, preempts the lowest priority when the pool is full, leaves finished prompts'
blocks cached and shares a common system-prompt prefix — enough for every panel to have
something true-looking to show. Every message goes through `vconsole.telemetry.schema.encode`, so the
frames are exactly what a real publisher sends. Deterministic for a given seed.

Request latencies (TTFT, ITL, e2e, queue ...) go through the engine's own
`vconsole.engine.latency.LatencyStats`, stamped on a toy clock that spreads each window's steps
evenly; they draw no random numbers, so adding them leaves every other topic as it was.

Scenario knobs (the advisor's tests; every default leaves the stream as it was): prompt and
output lengths, the policy the toy reports, extra config values, when the scheduler is slow, when
arrivals burst, and the execute time per step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vconsole.engine.latency import LatencyStats
from vconsole.shared.config import KV_CACHE_DTYPES, EngineConfig, describe_config
from vconsole.telemetry.schema import TOPICS, encode, make_envelope

T0 = 1_700_000_000.0
SHARED_PREFIX_BLOCKS = 2
# The toy pool's storage, as an int8 KV cache of a Llama-3-8B-like model would say it: 32
# layers x 8 KV heads x (128 int8 + a float32 scale) x K and V.
KV_FORMAT = ("int8_per_token_head", 2 * 32 * 8 * (128 + 4))


@dataclass
class _Req:
    id: str
    priority: int
    prompt: int
    target: int
    arrived: float
    output: int = 0
    state: str = "waiting"
    blocks: list[int] | None = None
    prefilled: bool = False
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class ToyEngine:
    """Just enough scheduling and block accounting to produce coherent numbers."""

    def __init__(self, *, seed: int = 0, num_blocks: int = 1024, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 rate: float = 9.0, engine: str = "tiny-0", rank: int = 0,
                 latency_window_s: float = 60.0, prompt_range: tuple[int, int] = (24, 480),
                 output_range: tuple[int, int] = (16, 160), policy: str | None = None,
                 config_overrides: dict[str, Any] | None = None,
                 kv_format: tuple[str, int] | None = KV_FORMAT) -> None:
        self.rng = random.Random(seed)
        self.kv_format = kv_format
        self.prompt_range, self.output_range = prompt_range, output_range
        self.policy = policy or "priority"
        self.latency = LatencyStats(latency_window_s)
        self.engine, self.rank = engine, rank
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.rate = rate
        self.owner = np.full(num_blocks, -1, dtype=np.int64)   # request number or -1
        self.cached = np.zeros(num_blocks, dtype=bool)
        self.free: list[int] = list(range(SHARED_PREFIX_BLOCKS, num_blocks))
        self.rng.shuffle(self.free)
        self.reqs: list[_Req] = []
        self.by_num: dict[int, _Req] = {}
        self.n = 0
        self.finished = 0
        self.preemptions = 0
        self.steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.seq = dict.fromkeys(TOPICS, 0)
        extra = dict(config_overrides or {})
        if policy is not None:
            extra.setdefault("policy", policy)
        if kv_format is not None and kv_format[0] in KV_CACHE_DTYPES:
            extra.setdefault("kv_cache_dtype", kv_format[0])
        self.config = EngineConfig(max_num_seqs=max_num_seqs, num_kv_blocks=num_blocks,
                                   block_size=block_size,
                                   max_num_batched_tokens=max_num_batched_tokens, **extra)

    # --- the toy scheduler -------------------------------------------------------------------

    def _arrive(self, now: float, dt: float, burst: float) -> None:
        lam = self.rate * burst * dt
        k = 0
        # Knuth's Poisson sampler: fine for the small means here.
        limit, p = math.exp(-lam), 1.0
        while True:
            p *= self.rng.random()
            if p <= limit:
                break
            k += 1
        for _ in range(k):
            self.n += 1
            prio = self.rng.choices((0, 1, 5), weights=(6, 3, 1))[0]
            r = _Req(f"req-{self.n:05d}", prio, self.rng.randint(*self.prompt_range),
                     self.rng.randint(*self.output_range), now)
            self.reqs.append(r)
            self.by_num[self.n] = r

    def _blocks_needed(self, r: _Req) -> int:
        return max(1, math.ceil((r.prompt + r.output + 1) / self.block_size))

    def _alloc(self, num: int) -> int | None:
        if self.free:
            b = self.free.pop()
        else:
            cached = np.flatnonzero(self.cached & (self.owner < 0))
            if not len(cached):
                return None
            b = int(cached[self.rng.randrange(len(cached))])
        self.cached[b] = False
        self.owner[b] = num
        return b

    def _release(self, num: int, r: _Req, keep_cached: bool) -> None:
        for i, b in enumerate(r.blocks or ()):
            if b < SHARED_PREFIX_BLOCKS:
                continue
            self.owner[b] = -1
            if keep_cached and i * self.block_size < r.prompt:
                self.cached[b] = True
            else:
                self.free.append(b)
        r.blocks = None

    def _num(self, r: _Req) -> int:
        return int(r.id.split("-")[1])

    def step_window(self, now: float, dt: float, burst: float, steps: int) -> dict[str, int]:
        self._arrive(now, dt, burst)
        prefill = decode = preempted = 0
        for k in range(steps):
            self.steps += 1
            t = now + (k + 1) * dt / steps   # this step's time on the toy clock
            running = [r for r in self.reqs if r.state == "running"]
            waiting = sorted((r for r in self.reqs if r.state != "running"),
                             key=lambda r: (r.priority, r.arrived))
            budget = self.max_tokens - len(running)
            for r in waiting:
                if len(running) >= self.max_num_seqs or budget < r.prompt:
                    break
                num = self._num(r)
                blocks = list(range(SHARED_PREFIX_BLOCKS))
                for _ in range(self._blocks_needed(r) - SHARED_PREFIX_BLOCKS):
                    b = self._alloc(num)
                    if b is None:
                        break
                    blocks.append(b)
                r.blocks = blocks
                self.prefix_queries += r.prompt
                self.prefix_hits += min(r.prompt, SHARED_PREFIX_BLOCKS * self.block_size)
                r.state = "running"
                if r.scheduled is None:
                    r.scheduled = t
                budget -= r.prompt
                prefill += r.prompt
                running.append(r)
            urgent = [r for r in waiting if r.state == "waiting"]
            if urgent and len(running) >= self.max_num_seqs:
                victim = max(running, key=lambda x: (x.priority, x.arrived))
                if urgent[0].priority < victim.priority and self.rng.random() < 0.2:
                    self._release(self._num(victim), victim, keep_cached=False)
                    victim.state = "preempted"
                    running.remove(victim)
                    self.preemptions += 1
                    preempted += 1
            for r in list(running):
                if r.state != "running":
                    continue
                r.output += 1
                decode += 1
                self._token(r, t)
                if r.blocks is not None and len(r.blocks) < self._blocks_needed(r):
                    b = self._alloc(self._num(r))
                    if b is None:
                        victim = max(running, key=lambda x: (x.priority, -x.arrived))
                        self._release(self._num(victim), victim, keep_cached=False)
                        victim.state = "preempted"
                        running.remove(victim)
                        self.preemptions += 1
                        preempted += 1
                        continue
                    r.blocks.append(b)
                if r.output >= r.target:
                    self._release(self._num(r), r, keep_cached=True)
                    r.state = "finished"
                    running.remove(r)
                    self.finished += 1
                    self._finish(r, t)
            self.reqs = [r for r in self.reqs if r.state != "finished"]
        return {"prefill": prefill, "decode": decode, "preempted": preempted}

    def _token(self, r: _Req, t: float) -> None:
        if r.first_token is None:
            r.first_token = t
            self.latency.observe("ttft_s", t - r.arrived, r.priority, t)
        elif r.last_token is not None:
            self.latency.observe("itl_s", t - r.last_token, r.priority, t)
        r.last_token = t

    def _finish(self, r: _Req, t: float) -> None:
        lat, prio = self.latency, r.priority
        lat.finish("length")
        lat.observe("e2e_s", t - r.arrived, prio, t)
        if r.scheduled is not None:
            lat.observe("queue_s", r.scheduled - r.arrived, prio, t)
        if r.scheduled is not None and r.first_token is not None and r.last_token is not None:
            lat.observe("prefill_s", r.first_token - r.scheduled, prio, t)
            lat.observe("decode_s", r.last_token - r.first_token, prio, t)
            lat.observe("inference_s", r.last_token - r.scheduled, prio, t)

    # --- payloads ----------------------------------------------------------------------------

    def block_states(self) -> np.ndarray:
        states = np.zeros(self.num_blocks, dtype=np.uint8)
        states[self.owner >= 0] = 1
        states[self.cached & (self.owner < 0)] = 2
        if any(r.state == "running" for r in self.reqs):
            states[:SHARED_PREFIX_BLOCKS] = 3
        return states

    def frames(self, topic: str, body: dict[str, Any], ts: float) -> list[Any]:
        env = make_envelope(self.engine, self.rank, self.seq[topic], ts)
        self.seq[topic] += 1
        return encode(topic, {**env, **body})

    def sched_body(self, now: float) -> dict[str, Any]:
        rows = [{"id": r.id, "state": r.state, "priority": r.priority,
                 "num_prompt_tokens": r.prompt, "num_output_tokens": r.output,
                 "num_blocks": len(r.blocks or ()), "age_s": round(now - r.arrived, 3)}
                for r in self.reqs]
        return {
            "num_waiting": sum(r.state != "running" for r in self.reqs),
            "num_running": sum(r.state == "running" for r in self.reqs),
            "num_preempted": sum(r.state == "preempted" for r in self.reqs),
            "num_preemptions_total": self.preemptions, "num_finished_total": self.finished,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_tokens,
            "policy": self.policy, "requests": rows, "requests_truncated": False,
            "snapshot_ts": now,
        }

    def kv_body(self, now: float) -> dict[str, Any]:
        states = self.block_states()
        counts = np.bincount(states, minlength=4)
        used = int(counts[1] + counts[3])
        live = [r for r in self.reqs if r.blocks]
        tokens = sum(r.prompt + r.output for r in live)
        slots = sum(len(r.blocks or ()) for r in live) * self.block_size
        return {
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_free": int(counts[0]), "num_used": used, "num_cached": int(counts[2]),
            "num_shared": int(counts[3]), "usage": used / self.num_blocks,
            "token_usage": (used / self.num_blocks) * (1 - (1 - tokens / slots if slots else 0.0)),
            "fragmentation": max(0.0, 1 - tokens / slots) if slots else 0.0,
            "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries
            else 0.0,
            "block_states": states, "snapshot_ts": now,
            **self.kv_format_fields(),
        }

    def kv_format_fields(self) -> dict[str, Any]:
        """How the pool stores tokens, as the engine says it (none: an engine from before)."""
        if self.kv_format is None:
            return {}
        dtype, per_token = self.kv_format
        capacity = self.num_blocks * self.block_size
        return {"cache_dtype": dtype, "bytes_per_token": per_token,
                "capacity_tokens": capacity, "pool_bytes": capacity * per_token}


Window = tuple[float, float] | Callable[[int, float], bool]


def _inside(window: Window, i: int, frac: float) -> bool:
    """Is window ``i`` (at ``frac`` of the run) inside ``window``: (from, to) fractions of the
    run, or a predicate ``(i, frac) -> bool``."""
    return window(i, frac) if callable(window) else window[0] < frac < window[1]


def generate(duration_s: float = 30.0, *, seed: int = 0, t0: float = T0, hz: float = 5.0,
             gpu: bool = True, latency: bool = True, slow_window: Window = (0.3, 0.55),
             burst_window: Window = (0.45, 0.97), burst: float = 2.2, exec_s: float = 0.0140,
             **engine_kw: Any) -> Iterator[tuple[float, list[Any]]]:
    """(receive time, frames) records of a ``duration_s`` run, in time order.

    A burst of arrivals in the middle fills the queue (waiting alerts fire and clear) and makes
    the scheduler slow for a while (the scheduler-share warning). ``latency``: also send the
    ``latency`` topic once a second, as the engine does (False: a stream from before the topic
    existed, like tests/data/synthetic.vrec; every other message is the same either way).
    Scenario knobs: ``slow_window`` / ``burst_window`` where the scheduler is slow / arrivals
    come ``burst`` times faster; ``exec_s`` the execute time per step; the rest go to
    `ToyEngine` (``prompt_range``, ``output_range``, ``policy``, ``config_overrides`` ...)."""
    eng = ToyEngine(seed=seed, **engine_kw)
    rng = eng.rng
    dt = 1.0 / hz
    uptime0 = 3723.0
    cfg = eng.config.to_dict()
    yield t0, eng.frames("config", {"version": 1, "values": cfg, "schema": describe_config()}, t0)
    alert_levels: dict[str, str] = {}
    n = int(duration_s * hz)
    for i in range(n + 1):
        now = t0 + i * dt
        frac = i / max(1, n)
        factor = burst if _inside(burst_window, i, frac) else 1.0
        steps = rng.randint(6, 9)
        done = eng.step_window(now, dt, factor, steps)
        slow = _inside(slow_window, i, frac)
        sched_s = steps * (0.0042 if slow else 0.0011) * rng.uniform(0.9, 1.1)
        exec_total = steps * exec_s * rng.uniform(0.9, 1.1)
        upd_s = steps * 0.0009 * rng.uniform(0.9, 1.1)
        busy = sched_s + exec_total + upd_s
        step = {"steps": steps, "window_s": dt,
                "phase_s": {"schedule": sched_s, "execute": exec_total, "update": upd_s},
                "busy_s": busy, "step_time_p50_s": busy / steps,
                "step_time_max_s": busy / steps * rng.uniform(1.2, 2.5),
                "num_prefill_tokens": done["prefill"], "num_decode_tokens": done["decode"],
                "num_preempted": done["preempted"],
                "tokens_per_s": (done["prefill"] + done["decode"]) / dt,
                "steps_per_s": steps / dt, "sched_share": sched_s / busy}
        yield now + 0.001, eng.frames("step", step, now)
        sched = eng.sched_body(now)
        yield now + 0.002, eng.frames("sched", sched, now)
        kv = eng.kv_body(now)
        yield now + 0.003, eng.frames("kv", kv, now)
        for name, value, warn, crit, what in (
                ("waiting", sched["num_waiting"], 50, 100, "waiting requests"),
                ("sched_share", step["sched_share"], 0.15, None, "scheduler share of step time")):
            lvl = "critical" if crit is not None and value >= crit else \
                "warning" if value >= warn else "ok"
            if lvl != alert_levels.get(name, "ok"):
                thr = crit if lvl == "critical" else warn
                shown = f"{value:.0%}" if isinstance(warn, float) else f"{value:g}"
                msg = (f"{what} back to {shown}" if lvl == "ok"
                       else f"{what} is {shown} (>= {lvl} threshold {thr:g})")
                yield now + 0.004, eng.frames("alert", {
                    "name": name, "level": lvl, "previous": alert_levels.get(name, "ok"),
                    "value": float(value), "threshold": float(thr), "message": msg}, now)
                alert_levels[name] = lvl
        if i % int(hz) == 0:
            load = min(1.0, sched["num_running"] / eng.max_num_seqs)
            if gpu:
                g = {"available": True, "error": None, "devices": [{
                    "index": 0, "name": "NVIDIA H200", "util": round(35 + 60 * load),
                    "mem_used": int((78 + 40 * load) * 2**30), "mem_total": 141 * 2**30,
                    "temp_c": int(48 + 20 * load), "power_w": round(180 + 400 * load, 1),
                    "sm_clock_mhz": 1980}]}
            else:
                g = {"available": False, "devices": [],
                     "error": "NVML library (libnvidia-ml.so) not found: no NVIDIA driver "
                              "installed"}
            yield now + 0.005, eng.frames("gpu", g, now)
            yield now + 0.006, eng.frames("host", {
                "pid": 4242, "proc_cpu_percent": round(95 + 60 * load, 1),
                "proc_rss_bytes": int(1.3 * 2**30), "proc_num_threads": 23,
                "sys_cpu_percent": round(18 + 30 * load, 1), "sys_cpu_count": 16,
                "sys_mem_used": int(21.4 * 2**30), "sys_mem_total": 128 * 2**30,
                "sys_mem_available": int(106.6 * 2**30)}, now)
            yield now + 0.007, eng.frames("health", {
                "state": "running" if eng.reqs else "idle", "uptime_s": uptime0 + i * dt,
                "steps": eng.steps, "interval_s": 1.0, "pid": 4242, "started_ts": t0 - uptime0,
                "send_drops": 0, "steps_dropped": 0,
                "alerts_active": {k: v for k, v in alert_levels.items() if v != "ok"}}, now)
            if latency:
                yield now + 0.0075, eng.frames("latency", eng.latency.snapshot(now), now)
        if i and i % int(5 * hz) == 0:
            yield now + 0.008, eng.frames("config", {"version": 1, "values": cfg,
                                                     "schema": describe_config()}, now)


def write_recording(path: str | Path, **kw: Any) -> int:
    """Write `generate(**kw)` to ``path`` with vconsole.telemetry.record's Recorder; returns records."""
    from vconsole.telemetry.record import Recorder

    with Recorder(path) as rec:
        for ts, frames in generate(**kw):
            rec.write(frames, ts)
        return rec.count
