"""`vconsole bench quality`: the engine's perplexity (through its prompt logprobs) and greedy
output beside transformers' on the same tokens, as a process printing JSON; and how a greedy
miss is named (a near-tie is float reassociation, anything else a mismatch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vconsole.tools.bench.quality import NEAR_TIE, describe_miss, first_difference


@pytest.mark.proc
def test_bench_quality_on_tiny_matches_transformers_and_prints_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "quality", "--model",
                           "tiny", "--windows", "2", "--window-tokens", "64", "--chat-prompts",
                           "3", "--new-tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"] == "tiny" and out["windows"] == 2 and out["window_tokens"] == 64
    assert out["tokens_scored"] == 2 * 63
    # Random weights: near-uniform over the 259-token vocabulary, far from a real model's.
    assert 50 < out["reference_ppl"] < 5000
    assert abs(out["rel_diff"]) < 1e-5 and out["rel_diff"] == pytest.approx(
        out["ppl"] / out["reference_ppl"] - 1)
    assert out["greedy_match"] == "3/3" and out["misses"] == [] and out["passed"] is True
    assert set(out["timings_s"]) >= {"engine_ppl_s", "reference_ppl_s", "engine_greedy_s",
                                     "reference_greedy_s"}


@pytest.mark.proc
def test_bench_quality_names_its_chunk_and_text_and_the_noise_a_run_can_resolve() -> None:
    """``--chunk`` is the step each window is scored in (a quantized KV cache is read back by
    every chunk after the first), ``--text`` the held-out text; both are named in the JSON,
    with the perplexity change's own 2-standard-error band."""
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "quality", "--model",
                           "tiny", "--windows", "2", "--window-tokens", "64", "--chat-prompts",
                           "1", "--new-tokens", "4", "--kv-cache-dtype", "int8_kivi",
                           "--chunk", "16", "--text", "python-license", "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_cache_dtype"] == "int8_kivi" and out["chunk_tokens"] == 16
    assert out["chunks_per_window"] == 4 and out["text_name"] == "python-license"
    assert "LICENSE" in out["text"]
    assert out["rel_diff"] != 0.0 and 0 < out["rel_diff_2se"] < 0.05
    assert 0 < out["token_logprob_diff_mean"] <= out["token_logprob_diff_p99"]
    # The change against auto on the same windows in the same chunks, the chunk named.
    vs = out["vs_auto"]
    assert vs["chunk_tokens"] == 16 and "int8_kivi against auto" in vs["summary"]
    assert "chunks of 16 tokens" in vs["summary"] and "python-license" in vs["summary"]
    assert vs["rel_diff"] == pytest.approx(out["ppl"] / vs["ppl_auto"] - 1)
    assert vs["rel_diff"] != 0.0 and 0 < vs["rel_diff_2se"] < 0.05
    assert vs["token_logprob_diff_mean"] > 0
    bad = subprocess.run([sys.executable, "-m", "vconsole", "bench", "quality", "--model",
                          "tiny", "--chunk", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "chunk" in bad.stderr


def test_a_greedy_miss_names_its_first_step_and_whether_it_is_a_near_tie() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2          # one stopped early
    tie = torch.tensor([0.0, 5.0, 5.0 - NEAR_TIE / 2, 1.0])
    clear = torch.tensor([0.0, 5.0, 4.0, 1.0])
    near = describe_miss(0, [7, 2], [7, 1], [clear, tie])
    assert near["step"] == 1 and near["kind"] == "float reassociation"
    assert near["engine_token"] == 2 and near["reference_token"] == 1
    assert near["top2_gap"] == pytest.approx(NEAR_TIE / 2, rel=0.01)   # float32 logits
    far = describe_miss(1, [3], [1], [clear])
    assert far["kind"] == "mismatch" and far["top2_gap"] == pytest.approx(1.0)
    # A near-tie at the top does not excuse an engine token outside it.
    outside = describe_miss(2, [0], [1], [tie])
    assert outside["kind"] == "mismatch" and outside["top2_gap"] < NEAR_TIE
    assert describe_miss(3, [1], [2], [tie])["kind"] == "float reassociation"  # either of two
