"""`vconsole bench scheduler` and `vconsole bench kvmap`: each runs on a small size as a process
and prints JSON with every figure the README quotes. Timings are only checked for sanity (a
shared test machine makes them meaningless as pass/fail criteria)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.proc


def bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", *args, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --json: no progress lines
    return json.loads(proc.stdout)


def test_scheduler_bench_reports_every_policy_and_size_with_the_goal():
    out = bench("scheduler", "--sizes", "100,1000", "--steps", "20")
    rows = out["results"]
    assert {(r["policy"], r["num_waiting"]) for r in rows} == {
        (p, n) for p in ("fcfs", "priority", "hybrid") for n in (100, 1000)}
    for r in rows:
        assert r["num_running"] == 256
        assert r["schedule_us"] > 0 and r["update_us"] > 0
        assert r["min_running"] >= 250      # seats refill every step: 256 stay busy
        assert r["preemptions"] == 0        # the pool is sized so that the 256 fit
        assert r["finished_per_step"] > 0   # requests finish and are replaced
    goal = out["goal"]
    assert set(goal["policies"]) == {"fcfs", "priority", "hybrid"}
    for g in goal["policies"].values():
        assert g["max_waiting"] == 1000 and g["ratio_of"] == "t(1000)/t(100)"
        assert g["ratio"] > 0 and g["step_us_at_max"] > 0
        assert isinstance(g["step_met"], bool) and isinstance(g["ratio_met"], bool)
    assert isinstance(goal["met"], bool)


def test_scheduler_bench_rejects_a_bad_size_list():
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "scheduler", "--sizes",
                           "100,x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--sizes" in proc.stderr


def test_kvmap_bench_round_trips_a_mixed_map_through_zmq():
    out = bench("kvmap", "--num-blocks", "10000", "--rounds", "5")
    assert out["num_blocks"] == 10000
    assert out["roundtrip_ms"] > 0 and out["rounds"] == 5
    assert all(v >= 0 for v in out["phases_ms"].values())
    # One byte per block plus a small msgpack payload: no compression, no bloat.
    assert 10000 <= out["wire_bytes"] <= 10000 + 2048
    mix = out["state_mix"]
    assert set(mix) == {"free", "used", "cached", "shared"}
    assert all(share > 0 for share in mix.values())
    assert abs(sum(mix.values()) - 1) < 0.01
    goal = out["goal"]
    assert goal["wire_bytes_max"] == 1_100_000 and goal["roundtrip_ms_max"] == 5.0
    assert goal["wire_met"] is True
    assert isinstance(goal["roundtrip_met"], bool)
