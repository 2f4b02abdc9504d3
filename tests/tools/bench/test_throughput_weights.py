"""`vconsole bench throughput`'s weights figures (issue #30): ``--quantization int8`` runs the
engine on int8 weights and the same single stream on float32 beside it, the decode step time at
the workload's batch is reported, and ``--peer llama-cpp`` refuses clearly what it cannot run."""

from __future__ import annotations

import argparse
import sys

import pytest

from vconsole.tools.bench import throughput as tp
from vconsole.tools.bench import throughput_engine, throughput_peers


def _args(**over) -> argparse.Namespace:
    base = dict(model_config="tiny", runs=1, num_requests=2, json=True, threads=None,
                peer=None, quantization=None, kv_cache_dtype="auto", no_transformers=True,
                concurrency=None)
    return argparse.Namespace(**{**base, **over})


@pytest.mark.slow
def test_int8_run_reports_both_single_streams_and_the_decode_step_time(monkeypatch):
    monkeypatch.setattr(throughput_engine.run_single_stream, "__defaults__", (24,))
    out = tp.throughput(_args(quantization="int8", concurrency=[1, 3]))
    assert out["quantization"] == "int8" and out["engine"]["quantization"] == "int8"
    assert "hf_static" not in out and "goal" not in out     # --no-transformers
    single, base = out["single_stream"], out["single_stream_float32"]
    assert single["quantization"] == "int8" and base["quantization"] is None
    assert single["output_tokens"] == base["output_tokens"] == 24
    assert single["weight_mb_per_token"] * 4 == pytest.approx(base["weight_mb_per_token"],
                                                               rel=0.01)
    assert out["single_stream_vs_float32"] == round(
        single["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
    step = out["engine"]["decode_step_ms"]
    assert step["mean"] > 0 and step["median"] > 0 and step["rows"] >= 1
    goal = out["weights_goal"]
    assert goal["single_stream_vs_float32"] == 2.0
    assert set(goal["met"]) == {"single_stream_vs_float32"}   # no peer: nothing else judged
    # Against float32 at each concurrency (issue #49), on the CPU it names.
    vs = out["vs_float32"]
    assert set(vs["levels"]) == {"1", "3"} and vs["quantization"] == "int8"
    assert "vector_extensions" in vs["cpu"] and vs["many_rows_path"].startswith("int8 · ")
    for c, level in vs["levels"].items():
        assert level["requests"] == 2 * int(c)
        (r,) = level["rounds"]
        assert r["ratio"] == round(r["quantized"]["tokens_per_s"]
                                   / r["float32"]["tokens_per_s"], 2) == level["ratio_median"]
    assert vs["passed"] == (vs["levels"]["1"]["ratio_median"] >= 1.8
                            and vs["levels"]["3"]["ratio_median"] >= 1.0)


def test_the_llama_cpp_peer_without_the_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)      # import fails
    with pytest.raises(SystemExit, match=r"vconsole\[llama-cpp\]"):
        throughput_peers.load_llama_cpp(1)


def test_the_llama_cpp_peer_runs_only_smollm2():
    with pytest.raises(SystemExit, match="--model-config smollm2"):
        tp.throughput(_args(peer="llama-cpp"))
