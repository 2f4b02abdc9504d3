"""`vconsole bench fleet` at a small size: it runs the stand-ins in their own process, reads
them as the Fleet screen does, and reports the refresh, the CPU share, each row's refresh gap
and how soon the killed target showed down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.ports import free_block

pytestmark = [pytest.mark.proc, pytest.mark.slow]


def test_a_small_fleet_bench_reports_every_figure_and_sees_the_kill():
    r = subprocess.run([sys.executable, "-m", "vconsole", "bench", "fleet", "--targets", "6",
                        "--engines", "0", "--seconds", "4", "--base-port", str(free_block(8)), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["targets"], out["stand_ins"], out["problems"]) == (6, 6, [])
    assert out["refresh_ms"]["n"] > 10 and out["refresh_ms"]["p99"] is not None
    assert 0 < out["cpu_share"] < 1
    assert out["row_gap_s"]["max"] < 5            # the others kept being read
    assert out["killed_down_after_s"] is not None and out["killed_down_after_s"] < 15
