"""`vconsole top` and the aggregate over a data-parallel group's ranks.

The aggregate (`vconsole.console.ranks`) is checked on hand-made bodies; `top --once --json`
against a synthetic 2-rank stream published on a real PUB socket, as a front end's telemetry
endpoint carries it (every rank's messages, the envelope's ``rank`` apart).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import pytest
import zmq

from support.synthetic import generate
from support.synthetic_dp import generate_dp
from vconsole.commands import top as top_cmd
from vconsole.console.ranks import aggregate, imbalance, is_imbalanced
from vconsole.telemetry.schema import DP_TOPICS, decode
from vconsole.tools import top

# --- the aggregate ---------------------------------------------------------------------------


def bodies(waiting: int, running: int, *, used: int, blocks: int, tok_s: float,
           dummy_share: float, steps: int, wave: int, running_wave: bool = True,
           state: str = "ok") -> dict[str, dict]:
    return {
        "sched": {"num_waiting": waiting, "num_running": running, "num_preempted": 1},
        "step": {"tokens_per_s": tok_s, "steps_per_s": 10.0,
                 "phase_s": {"schedule": 0.01, "execute": 0.08, "update": 0.01}},
        "kv": {"num_used": used, "num_blocks": blocks},
        "dp": {"world_size": 2, "wave": wave, "wave_running": running_wave,
               "group_state": state, "steps_total": steps, "dummy_share": dummy_share,
               "dummy_steps_total": round(dummy_share * steps), "sync_s_per_step": 0.0002},
    }


def test_the_aggregate_sums_queues_weights_kv_by_blocks_and_averages_the_dummy_share():
    agg = aggregate({0: bodies(10, 6, used=90, blocks=100, tok_s=500.0, dummy_share=0.0,
                               steps=300, wave=4),
                     1: bodies(0, 2, used=10, blocks=300, tok_s=100.0, dummy_share=0.5,
                               steps=100, wave=3, running_wave=False, state="broken")})
    assert (agg["num_waiting"], agg["num_running"], agg["num_preempted"]) == (10, 8, 2)
    assert agg["tokens_per_s"] == 600.0 and agg["steps_per_s"] == 20.0
    assert agg["kv_usage"] == pytest.approx(100 / 400)          # not the mean 0.466
    assert agg["dummy_share"] == pytest.approx(0.25)            # the ranks' windows, lockstep
    assert agg["dummy_share_total"] == pytest.approx(50 / 400)  # Σ dummy / Σ steps
    assert agg["phase_s"]["execute"] == pytest.approx(0.16)
    assert agg["sched_share"] == pytest.approx(0.1)
    assert agg["wave"] == 4 and not agg["waves_agree"] and agg["wave_running"]
    assert agg["group_states"] == {"ok": 1, "broken": 1}
    assert agg["load"] == {"0": 16, "1": 2}
    assert agg["imbalance"] == pytest.approx(16 / 9) and agg["imbalanced"]
    assert agg["world_size"] == 2 and agg["ranks"] == 2


def test_the_aggregate_names_the_groups_kv_format_and_sums_its_capacity():
    one, two = (bodies(0, 1, used=1, blocks=100, tok_s=1.0, dummy_share=0.0, steps=1, wave=1)
                for _ in range(2))
    for b, dtype in ((one, "int8_per_token_head"), (two, "int8_per_token_head")):
        b["kv"].update(cache_dtype=dtype, bytes_per_token=1088, capacity_tokens=1600,
                       pool_bytes=1600 * 1088)
    agg = aggregate({0: one, 1: two})
    assert (agg["kv_cache_dtype"], agg["kv_bytes_per_token"]) == ("int8_per_token_head", 1088)
    assert agg["kv_capacity_tokens"] == 3200 and agg["kv_pool_bytes"] == 2 * 1600 * 1088
    two["kv"].update(cache_dtype="float32", bytes_per_token=4096)   # ranks that disagree
    agg = aggregate({0: one, 1: two})
    assert agg["kv_cache_dtype"] == "float32, int8_per_token_head"
    assert agg["kv_bytes_per_token"] is None
    for b in (one, two):                      # engines from before the KV dtypes
        b["kv"] = {"num_used": 1, "num_blocks": 100}
    agg = aggregate({0: one, 1: two})
    assert agg["kv_cache_dtype"] is None and agg["kv_capacity_tokens"] is None


def test_imbalance_is_max_over_mean_and_flags_only_real_load():
    assert imbalance([5]) is None
    assert imbalance([0, 0]) == 1.0
    assert imbalance([6, 2]) == pytest.approx(1.5)
    assert is_imbalanced([6, 2]) and not is_imbalanced([5, 5])
    assert not is_imbalanced([1, 0])        # one request against none is not a problem
    assert aggregate({})["num_waiting"] is None and aggregate({})["imbalance"] is None


# --- top over a real PUB socket ----------------------------------------------------------------

class Publisher:
    """Plays ``records`` on a PUB socket in a loop (a live endpoint repeats its topics), with
    ``hold_rank`` held back for the first ``hold_s`` seconds."""

    def __init__(self, ctx: zmq.Context, records, *, hold_rank: int | None = None,
                 hold_s: float = 0.0) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.records = [(decode(f).rank, f) for _, f in records]
        self.hold_rank, self.hold_s = hold_rank, hold_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.is_set():
            for rank, frames in self.records:
                if rank == self.hold_rank and time.monotonic() - start < self.hold_s:
                    continue
                self.sock.send_multipart(frames)
            self.stop.wait(0.05)
        self.sock.close(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)



def test_top_once_json_gives_each_rank_and_the_aggregate(ctx, capsys):
    # Rank 1 starts late: top must not stop at rank 0's complete set, since dp names 2 ranks.
    recs = list(generate_dp(2, 6, rates=(9.0, 1.0)))
    pub = Publisher(ctx, recs, hold_rank=1, hold_s=1.0)
    try:
        rc = top_cmd.main(argparse.Namespace(telemetry=pub.endpoint, control=None, once=True,
                                             json=True, timeout=10.0))
    finally:
        pub.close()
    out, err = capsys.readouterr()
    assert rc == 0, err
    snap = json.loads(out)
    assert set(snap) == {"ranks", "aggregate"}
    assert set(snap["ranks"]) == {"0", "1"}
    for rank, topics in snap["ranks"].items():
        assert set(topics) >= {*top.WAIT_FOR, "dp"}, rank
        assert all(body["rank"] == int(rank) for body in topics.values())
        assert topics["kv"]["block_states"]["num_blocks"] == 1024
    agg, r0, r1 = snap["aggregate"], snap["ranks"]["0"], snap["ranks"]["1"]
    assert agg["num_running"] == r0["sched"]["num_running"] + r1["sched"]["num_running"]
    assert agg["tokens_per_s"] == pytest.approx(r0["step"]["tokens_per_s"] +
                                                r1["step"]["tokens_per_s"])
    assert agg["kv_usage"] == pytest.approx(
        (r0["kv"]["num_used"] + r1["kv"]["num_used"]) / 2048)
    assert agg["world_size"] == 2 and agg["wave"] == max(r0["dp"]["wave"], r1["dp"]["wave"])
    # how each rank's pool stores tokens, and the group's capacity (issue #30)
    assert r0["kv"]["cache_dtype"] == r1["kv"]["cache_dtype"] == agg["kv_cache_dtype"] \
        == "int8_per_token_head"
    assert agg["kv_bytes_per_token"] == r0["kv"]["bytes_per_token"] == 67_584
    assert agg["kv_capacity_tokens"] == r0["kv"]["capacity_tokens"] * 2 == 2 * 1024 * 16


def test_top_of_a_lone_engine_keeps_its_shape(ctx):
    pub = Publisher(ctx, list(generate(duration_s=2)))
    try:
        snap, missing = top.snapshot_once(pub.endpoint, None, 10.0, ctx)
    finally:
        pub.close()
    assert missing == []
    assert "ranks" not in snap and set(snap) >= set(top.WAIT_FOR)
    assert not set(snap) & set(DP_TOPICS)
    assert list(snap) == [t for t in top.TOPICS if t in snap]
    kv = snap["kv"]        # ``top --once --json | jq .kv.cache_dtype``
    assert (kv["cache_dtype"], kv["bytes_per_token"], kv["capacity_tokens"], kv["pool_bytes"]) \
        == ("int8_per_token_head", 67_584, 1024 * 16, 1024 * 16 * 67_584)
    line = top.format_line(snap)
    assert "kv_dtype=int8_per_token_head" in line


def test_top_names_the_rank_it_never_heard(ctx):
    recs = [r for r in generate_dp(2, 2) if decode(r[1]).rank == 0]   # rank 1 is dead
    pub = Publisher(ctx, recs)
    try:
        snap, missing = top.snapshot_once(pub.endpoint, None, 1.5, ctx)
    finally:
        pub.close()
    assert "rank 1: health" in missing and not any(m.startswith("rank 0") for m in missing)
    assert set(snap["ranks"]) == {"0", "1"} and snap["ranks"]["1"] == {}
