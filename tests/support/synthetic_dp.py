"""A synthetic data-parallel telemetry stream: N ranks of `synthetic.generate`, merged in time
order as one endpoint carries them, plus each rank's ``dp`` and ``wave`` topics.

Every rank is a toy engine of its own (seed ``seed + rank``, arrival rate ``rates[rank]``: give
ranks different rates to see load imbalance) with the same ``engine`` name and its ``rank`` in
the envelope. The group's waves follow vLLM's protocol on the toy's windows: a wave starts in
the first window where any rank has work and completes in the first one where none has; inside a
wave every rank runs as many steps as the busiest one (an idle rank's are dummy steps), and the
"anyone busy" all-reduce runs every ``sync_every`` steps. Deterministic for a given seed.

``stop_rank=(rank, frac)``: that rank's messages stop at ``frac`` of the run (a dead rank, whose
heartbeat goes stale). `showcase` is the stream the snapshots and screenshots use: light load
(waves complete and start again, idle ranks run dummy steps), then a burst on rank 0 alone
(load imbalance).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from support.synthetic import T0, generate
from vconsole.telemetry.schema import decode, encode, make_envelope

DP_OFFSET = 0.0085   # within a window: after the rank's own snapshot messages


def generate_dp(num_ranks: int = 2, duration_s: float = 30.0, *, seed: int = 0,
                t0: float = T0, hz: float = 5.0, rates: Sequence[float] | None = None,
                engine: str = "engine-0", sync_every: int = 4,
                stop_rank: tuple[int, float] | None = None,
                rank_kw: dict[int, dict[str, Any]] | None = None,
                **kw: Any) -> Iterator[tuple[float, list[Any]]]:
    """(receive time, frames) records of ``num_ranks`` ranks for ``duration_s``, in time order.
    The rest of ``kw`` goes to `synthetic.generate` for every rank, ``rank_kw[r]`` on top for
    rank ``r`` only (e.g. a burst of arrivals on one rank)."""
    rates = list(rates) if rates is not None else [9.0] * num_ranks
    if len(rates) != num_ranks:
        raise ValueError(f"rates: {len(rates)} values for {num_ranks} ranks")
    dt = 1.0 / hz
    rng = random.Random(seed * 7919 + num_ranks)
    streams = [list(generate(duration_s, seed=seed + r, t0=t0, hz=hz, engine=engine, rank=r,
                             rate=rates[r], **{**kw, **(rank_kw or {}).get(r, {})}))
               for r in range(num_ranks)]
    # Each rank's window: (steps, load) from its step and sched messages.
    windows: list[dict[int, list[float]]] = [{} for _ in range(num_ranks)]
    for r, recs in enumerate(streams):
        for _, frames in recs:
            topic = bytes(frames[0])
            if topic not in (b"step", b"sched"):
                continue
            p = decode(frames).payload
            i = round((p["ts"] - t0) / dt)
            w = windows[r].setdefault(i, [0.0, 0.0])
            if topic == b"step":
                w[0] = float(p["steps"])
            else:
                w[1] = float(p["num_waiting"] + p["num_running"])
    seq = [{"dp": 0, "wave": 0} for _ in range(num_ranks)]

    def msg(r: int, topic: str, body: dict[str, Any], ts: float) -> list[Any]:
        env = make_envelope(engine, r, seq[r][topic], ts)
        seq[r][topic] += 1
        return encode(topic, {**env, **body})

    extra: list[tuple[float, list[Any]]] = []
    steps = [0] * num_ranks
    dummy = [0] * num_ranks
    syncs = [0] * num_ranks
    sync_s = [0.0] * num_ranks
    wave, running = 0, False
    wave_start, wave_steps, wave_dummy = 0.0, [0] * num_ranks, [0] * num_ranks
    prev = [(0, 0)] * num_ranks         # (steps, dummy steps) at each rank's last dp message
    n = int(duration_s * hz)
    for i in range(n + 1):
        now = t0 + i * dt
        ts = now + DP_OFFSET
        got = [windows[r].get(i, [0.0, 0.0]) for r in range(num_ranks)]
        busy = [load > 0 for _, load in got]
        if not running and any(busy):
            running, wave_start = True, now
            wave_steps, wave_dummy = [0] * num_ranks, [0] * num_ranks
            for r in range(num_ranks):
                extra.append((ts, msg(r, "wave", {"event": "start", "wave": wave, "steps": 0,
                                                  "dummy_steps": 0, "duration_s": 0.0}, now)))
        real_steps = [int(s) if b else 0 for (s, _), b in zip(got, busy, strict=True)]
        lockstep = max(real_steps)
        for r in range(num_ranks):
            ran = lockstep if running else real_steps[r]
            idle = 0 if busy[r] else ran        # in lockstep: a busy rank's steps are real
            steps[r] += ran
            if running:
                dummy[r] += idle
                wave_steps[r] += ran
                wave_dummy[r] += idle
                k = max(1, ran // sync_every)
                syncs[r] += k
                sync_s[r] += k * rng.uniform(0.00012, 0.00030)
        completed = running and not any(busy)
        for r in range(num_ranks):
            if completed:
                extra.append((ts, msg(r, "wave", {
                    "event": "complete", "wave": wave, "steps": wave_steps[r],
                    "dummy_steps": wave_dummy[r], "duration_s": round(now - wave_start, 3)},
                    now)))
            extra.append((ts + 0.0001, msg(r, "dp", {
                "world_size": num_ranks, "wave": wave + 1 if completed else wave,
                "wave_running": running and not completed, "group_generation": 0,
                "group_state": "ok", "steps_total": steps[r], "dummy_steps_total": dummy[r],
                # Over the steps since this rank's previous dp message, as a rank reports it.
                "dummy_share": (dummy[r] - prev[r][1]) / (steps[r] - prev[r][0])
                if steps[r] > prev[r][0] else 0.0,
                "sync_every": sync_every, "sync_count_total": syncs[r],
                "sync_s_total": sync_s[r],
                "sync_s_per_step": sync_s[r] / steps[r] if steps[r] else 0.0}, now)))
        prev = [(steps[r], dummy[r]) for r in range(num_ranks)]
        if completed:
            wave, running = wave + 1, False
    records = [rec for recs in streams for rec in recs] + extra
    if stop_rank is not None:
        dead, frac = stop_rank
        cut = t0 + frac * duration_s
        records = [(ts, f) for ts, f in records
                   if ts < cut or decode(f).payload["rank"] != dead]
    records.sort(key=lambda rec: rec[0])
    return iter(records)


def showcase(num_ranks: int, duration_s: float = 30.0, **kw: Any
             ) -> Iterator[tuple[float, list[Any]]]:
    """Light load with short outputs for the first 70% of the run (waves advance), then rank 0
    alone gets 30x its arrivals (imbalance). ``kw`` as `generate_dp` (``stop_rank`` ...)."""
    return generate_dp(num_ranks, duration_s, rates=[2.0] + [0.4] * (num_ranks - 1),
                       output_range=(8, 30), burst_window=(0.7, 1.01), burst=1.0,
                       slow_window=(2.0, 2.0), rank_kw={0: {"burst": 30.0}}, **kw)
