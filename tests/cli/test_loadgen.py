"""The load generator: reproducible workloads, arrival shapes, the summary, and `vconsole load`
against a real engine."""

import json
import subprocess
import sys
import time

import pytest
import zmq

from vconsole.cli import build_parser
from vconsole.commands.load import main as loadgen_main
from vconsole.engine.proc.async_client import AsyncEngineClient
from vconsole.tools.loadgen import (
    LoadRun,
    LoadSpec,
    LoadThread,
    RequestRecord,
    Workload,
    _one,
    demo_rate,
    format_summary,
    parse_mix,
    parse_range,
)


def test_parse_range_and_mix():
    assert parse_range("16:128") == (16, 128) and parse_range("8") == (8, 8)
    assert parse_mix("0:1,5:3") == [(0, 1.0), (5, 3.0)]
    for bad in ("0:x", "-1:2", "9:3"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError):
        parse_mix("0:0")


def test_workload_is_reproducible_and_respects_its_ranges():
    spec = LoadSpec(prompt_len=(4, 9), output_len=(2, 3), priority_mix=[(0, 1), (7, 1)],
                    shared_prefix_share=0.5, shared_prefix_len=4, seed=11)
    a = [Workload(spec, 259, 2048).next() for _ in range(1)]
    w1, w2 = Workload(spec, 259, 2048), Workload(spec, 259, 2048)
    draws = [w1.next() for _ in range(200)]
    assert draws == [w2.next() for _ in range(200)] and draws[0] == a[0]
    assert all(4 <= len(ids) <= 9 and 2 <= out <= 3 and p in (0, 7) for ids, out, p in draws)
    assert all(3 <= t < 259 for ids, _, _ in draws for t in ids)
    assert {p for _, _, p in draws} == {0, 7}
    shared = sum(ids[:4] == w1.prefix for ids, _, _ in draws)
    assert 60 < shared < 140


def test_workload_fits_the_model_length():
    w = Workload(LoadSpec(prompt_len=(100, 100), output_len=(50, 50)), 259, 64)
    ids, out, _ = w.next()
    assert len(ids) + out <= 64


def test_demo_rate_has_bursts_and_quiet_spells():
    rate = demo_rate(4.0, period_s=40)
    values = [rate(t) for t in range(40)]
    assert max(values) == 12.0 and min(values) == pytest.approx(0.4)
    assert rate(5) == rate(45)


def test_summary_percentiles_and_errors_by_reason():
    run = LoadRun()
    run.started = 0.0
    run.finished_at = 2.0
    for i in range(10):
        run.records[str(i)] = RequestRecord(0, 5, sent=0.0, first_token=0.1 * (i + 1),
                                            itl=[0.01], num_tokens=4, finish_reason="length")
    run.records["x"] = RequestRecord(0, 5, finish_reason="error", error="too long")
    run.records["y"] = RequestRecord(0, 5, finish_reason="abort")
    run.tokens, run.done = 40, 12
    s = run.summary()
    assert s["requests"] == 12 and s["completed"] == 10
    assert s["errors"] == {"error: too long": 1, "abort": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.55) and s["itl_s"]["p99"] == pytest.approx(0.01)
    assert s["tok_per_s"] == 20.0
    text = format_summary(s)
    assert "TTFT" in text and "error: too long: 1" in text


async def test_a_failing_submit_raises_its_own_error_not_an_unbound_rid():
    """`_one`'s cleanup must not mask the real error when `submit` raises (a closed client)."""
    c = AsyncEngineClient("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    await c.close()
    run, in_flight = LoadRun(), {"other": None}
    with pytest.raises(zmq.ZMQError):
        await _one(c, run, [5, 6, 7], 4, 0, in_flight)
    assert run.sent == run.done == 1 and in_flight == {"other": None}


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The session's shared engine (tests/conftest.py): these tests only use it."""
    return shared_engine


@pytest.mark.proc
def test_vconsole_load_runs_a_workload_and_prints_a_json_summary(engine):
    r = subprocess.run([sys.executable, "-m", "vconsole.cli", "load", "--input",
                        engine.endpoints["input"], "--output", engine.endpoints["output"],
                        "--num", "30", "--concurrency", "6", "--prompt-len", "4:16",
                        "--output-len", "2:6", "--priority-mix", "0:1,3:2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["requests"] == 30 and s["completed"] == 30 and s["errors"] == {}
    assert s["ttft_s"]["p50"] > 0 and s["itl_s"]["p99"] >= s["itl_s"]["p50"] > 0
    assert 60 <= s["output_tokens"] <= 180 and s["tok_per_s"] > 0


@pytest.mark.proc
def test_vconsole_load_with_poisson_rate_prints_a_text_summary(engine):
    r = subprocess.run([sys.executable, "-m", "vconsole.cli", "load", "--input",
                        engine.endpoints["input"], "--output", engine.endpoints["output"],
                        "--num", "10", "--rate", "50", "--prompt-len", "4:8",
                        "--output-len", "2:3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "requests     10 (10 completed)" in r.stdout and "errors       none" in r.stdout


def test_vconsole_load_without_engine_exits_1(tmp_path, capsys):
    args = build_parser().parse_args(["load", "--input", f"ipc://{tmp_path}/i", "--output",
                                      f"ipc://{tmp_path}/o", "--num", "1", "--wait", "1"])
    assert loadgen_main(args) == 1
    assert "no engine answered" in capsys.readouterr().err


@pytest.mark.proc
def test_load_thread_with_a_varying_rate_stops_promptly_and_aborts_what_is_in_flight(engine):
    spec = LoadSpec(num=None, concurrency=16, prompt_len=(4, 8), output_len=(200, 200))
    t = LoadThread(engine.endpoints["input"], engine.endpoints["output"], spec,
                   rate_fn=lambda s: 40.0 if s < 0.5 else 0.0)
    t.start()
    time.sleep(1.5)
    p = t.run_state.progress()
    assert p["sent"] >= 3 and p["in_flight"] > 0 and p["tokens"] > 0
    t.stop()
    assert not t.is_alive() and t.error is None
    # Promptly = without waiting for the in-flight requests (200 tokens each) to finish: they
    # were aborted (not all finished), and stop returned with the thread gone.
    s = t.run_state.summary()
    assert s["errors"].get("abort", 0) >= 1 and s["requests"] >= p["sent"]
    assert s["completed"] < s["requests"]
