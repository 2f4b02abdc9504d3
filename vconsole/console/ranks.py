"""Data-parallel figures across ranks: one aggregate of every rank's last telemetry, and the load
imbalance between ranks.

With `vconsole engine --data-parallel-size N` one telemetry endpoint carries every rank's
messages (the envelope's ``rank`` tells them apart). The console's Ranks screen and Overview,
and `vconsole top --json`, all sum them up here, so they never disagree. Input is plain payload
dicts, ``{rank: {topic: last body}}``; a topic a rank has not sent yet is simply left out of the
sums (``ranks_with`` says how many ranks each figure covers).

How each figure combines (the choice is part of the contract):

- queues (waiting, running, preempted), tokens/s, steps/s, phase seconds: sums over ranks;
  the scheduler share is Σ schedule / Σ (schedule + execute + update) of the last windows;
- KV usage: blocks-weighted, Σ used blocks / Σ blocks (a rank with a bigger pool counts more);
- KV capacity in tokens and pool bytes: sums; the cache dtype and bytes per token are the
  ranks' one value (one config for the group): ranks that differ are listed (dtype) or give
  None (bytes per token);
- dummy-step share: the mean of the ranks' ``dummy_share`` (each over the steps since its
  previous ``dp`` message). Inside a wave every rank runs the same steps (lockstep), so the mean
  is the group's share of dummy steps in that window; outside a wave none are run.
  ``dummy_share_total`` is Σ dummy steps / Σ steps since the ranks started;
- wave: the highest wave any rank is in (``waves_agree`` False while ranks differ, e.g. one
  rank has not heard a wave start yet); ``wave_running`` if any rank is in a wave;
- placement: each rank's ``node`` and ``actor`` (a Ray actor rank's name; None for processes),
  as its ``dp`` body says;
- load imbalance: max / mean of each rank's waiting + running (1.0 is perfectly even; None
  with fewer than two ranks). ``imbalanced`` once it reaches `IMBALANCE_WARN` with at least
  `IMBALANCE_MIN_LOAD` requests on the busiest rank (1 request against 0 is not a problem).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IMBALANCE_WARN = 1.5
IMBALANCE_MIN_LOAD = 4
PHASES = ("schedule", "execute", "update", "structured")

Bodies = Mapping[str, Mapping[str, Any]]


def _num(body: Mapping[str, Any] | None, key: str) -> float | None:
    v = body.get(key) if body else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def rank_load(bodies: Bodies) -> float | None:
    """Waiting + running requests of one rank (None before its first ``sched``)."""
    sc = bodies.get("sched")
    w, r = _num(sc, "num_waiting"), _num(sc, "num_running")
    return None if w is None or r is None else w + r


def imbalance(loads: Sequence[float]) -> float | None:
    """max / mean of the ranks' loads; 1.0 when all are idle, None with fewer than 2 ranks."""
    if len(loads) < 2:
        return None
    mean = sum(loads) / len(loads)
    return 1.0 if mean <= 0 else max(loads) / mean


def is_imbalanced(loads: Sequence[float], warn: float = IMBALANCE_WARN,
                  min_load: float = IMBALANCE_MIN_LOAD) -> bool:
    ratio = imbalance(loads)
    return ratio is not None and ratio >= warn and max(loads) >= min_load


def _sum(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return sum(real) if real else None


def aggregate(bodies_by_rank: Mapping[int, Bodies]) -> dict[str, Any]:
    """The group's figures from each rank's last bodies (see the module docstring)."""
    ranks = sorted(bodies_by_rank)
    per = [bodies_by_rank[r] for r in ranks]
    sched = [b.get("sched") for b in per]
    step = [b.get("step") for b in per]
    kv = [b.get("kv") for b in per]
    dp = [b.get("dp") for b in per]
    out: dict[str, Any] = {"ranks": len(ranks)}
    sizes = [_num(d, "world_size") for d in dp]
    out["world_size"] = int(max((s for s in sizes if s is not None), default=len(ranks)))
    for key in ("num_waiting", "num_running", "num_preempted", "num_finished_total",
                "num_preemptions_total"):
        out[key] = _sum([_num(s, key) for s in sched])
    for key in ("tokens_per_s", "steps_per_s"):
        out[key] = _sum([_num(s, key) for s in step])
    phase = {p: _sum([_num(s.get("phase_s") if s else None, p) for s in step]) for p in PHASES}
    out["phase_s"] = phase
    busy = sum(v or 0.0 for v in phase.values())
    out["sched_share"] = (phase["schedule"] or 0.0) / busy if busy > 0 else None
    used, blocks = _sum([_num(k, "num_used") for k in kv]), _sum([_num(k, "num_blocks")
                                                                 for k in kv])
    out["kv_num_used"], out["kv_num_blocks"] = used, blocks
    out["kv_usage"] = used / blocks if used is not None and blocks else None
    out["kv_capacity_tokens"] = _sum([_num(k, "capacity_tokens") for k in kv])
    out["kv_pool_bytes"] = _sum([_num(k, "pool_bytes") for k in kv])
    # One config for the group, so one format; ranks that disagree are named, not averaged.
    dtypes = sorted({k["cache_dtype"] for k in kv if k and isinstance(k.get("cache_dtype"), str)})
    out["kv_cache_dtype"] = ", ".join(dtypes) if dtypes else None
    per_token = {v for k in kv if (v := _num(k, "bytes_per_token")) is not None}
    out["kv_bytes_per_token"] = int(per_token.pop()) if len(per_token) == 1 else None
    shares = [s for d in dp if (s := _num(d, "dummy_share")) is not None]
    out["dummy_share"] = sum(shares) / len(shares) if shares else None
    out["dummy_steps_total"] = _sum([_num(d, "dummy_steps_total") for d in dp])
    out["steps_total"] = _sum([_num(d, "steps_total") for d in dp])
    out["dummy_share_total"] = (out["dummy_steps_total"] / out["steps_total"]
                                if out["dummy_steps_total"] is not None and out["steps_total"]
                                else None)
    waves = [int(w) for d in dp if (w := _num(d, "wave")) is not None]
    out["wave"] = max(waves) if waves else None
    out["waves_agree"] = len(set(waves)) <= 1
    out["wave_running"] = any(bool(d.get("wave_running")) for d in dp if d)
    states: dict[str, int] = {}
    for d in dp:
        if d and isinstance(d.get("group_state"), str):
            states[d["group_state"]] = states.get(d["group_state"], 0) + 1
    out["group_states"] = states
    per_step = [v for d in dp if (v := _num(d, "sync_s_per_step")) is not None]
    out["sync_s_per_step"] = sum(per_step) / len(per_step) if per_step else None
    loads = {r: load for r, b in zip(ranks, per, strict=True)
             if (load := rank_load(b)) is not None}
    out["load"] = {str(r): v for r, v in loads.items()}
    out["imbalance"] = imbalance(list(loads.values()))
    out["imbalanced"] = is_imbalanced(list(loads.values()))
    out["ranks_with"] = {t: sum(1 for b in per if t in b)
                         for t in ("sched", "step", "kv", "dp")}
    out["placement"] = placement(bodies_by_rank)
    return out


def placement(bodies_by_rank: Mapping[int, Bodies]) -> dict[str, dict[str, Any]]:
    """Where each rank runs, from its ``dp`` body: ``{"<rank>": {"node", "actor"}}`` (``actor``
    the Ray actor's name, None for a process rank; ranks that sent no ``dp`` are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(bodies_by_rank):
        dp = bodies_by_rank[r].get("dp")
        if dp and ("node" in dp or "actor" in dp):
            out[str(r)] = {"node": dp.get("node"), "actor": dp.get("actor")}
    return out


def placement_line(where: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The Ranks screen's line parts for Ray actor ranks (empty for process ranks: their node
    is this host): ``r0 vconsole_dp_rank_0 on node-a``."""
    if not any(p.get("actor") for p in where.values()):
        return []
    return [f"r{r} {p.get('actor') or 'process'} on {p.get('node') or '?'}"
            for r, p in where.items()]
