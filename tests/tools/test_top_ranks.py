"""`vconsole top` over a data-parallel group's ranks: `top --once --json` against a synthetic
2-rank stream published on a real PUB socket, as a front end's telemetry endpoint carries it
(every rank's messages, the envelope's ``rank`` apart). The aggregate itself
(`vconsole.console.ranks`): tests/console/test_ranks.py.
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
from vconsole.telemetry.schema import DP_TOPICS, decode
from vconsole.tools import top

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
