"""`vconsole bench spec` on the tiny model, as a process printing JSON: both workloads run on
both sides, the greedy outputs are identical, and the spec side's counters add up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.proc
@pytest.mark.slow
def test_bench_spec_on_tiny_prints_both_workloads_identical_and_counted() -> None:
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "spec", "--model", "tiny",
                           "--max-tokens", "6", "--num-chat", "2", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bench"] == "spec" and out["speculative_config"]["method"] == "ngram"
    assert set(out["workloads"]) == {"quoting", "chat"}
    assert out["workloads"]["quoting"]["requests"] == 12
    assert out["workloads"]["chat"]["requests"] == 2
    for w in out["workloads"].values():
        assert w["identical"] is True and w["diverged"] == []
        assert w["plain"]["output_tokens"] == w["spec"]["output_tokens"]
        assert w["speedup"] > 0
        c = w["spec_counters"]
        assert c["num_accepted_tokens"] == sum(c["accepted_per_pos"])
        assert c["num_accepted_tokens"] <= c["num_draft_tokens"]


@pytest.mark.proc
def test_bench_spec_refuses_a_bad_config() -> None:
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "spec", "--model", "tiny",
                           "--speculative-config", '{"method": "eagle"}', "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--speculative-config: method must be one of ngram" in proc.stderr
