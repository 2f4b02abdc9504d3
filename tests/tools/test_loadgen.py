"""The load generator: reproducible workloads, arrival shapes, the summary, and `vconsole load`
against a real engine."""

import json
import re
import subprocess
import sys
import time

import pytest
import zmq

from vconsole.cli import build_parser
from vconsole.commands.load import main as loadgen_main
from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.tools.load_summary import LoadRun, RequestRecord, format_summary
from vconsole.tools.loadgen import (
    LoadSpec,
    LoadThread,
    Workload,
    _one,
    demo_rate,
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


def test_summary_percentiles_and_errors_by_kind():
    run = LoadRun()
    run.started = 0.0
    run.finished_at = 2.0
    run.planned = 16
    done = {"ended": True}
    for i in range(10):
        run.records[str(i)] = RequestRecord(0, 5, sent=0.0, first_token=0.1 * (i + 1),
                                            itl=[0.01], num_tokens=4, finish_reason="length",
                                            **done)
    run.records["x"] = RequestRecord(0, 5, finish_reason="error", error="too long", **done)
    run.records["y"] = RequestRecord(0, 5, finish_reason="abort", **done)
    run.records["z"] = RequestRecord(0, 5, finish_reason="error", error="engine unreachable: "
                                     "nothing heard", **done)
    run.records["h"] = RequestRecord(0, 5, finish_reason="error", error="error_event: 503 "
                                     "ServiceUnavailableError: engine unreachable", **done)
    run.records["s"] = RequestRecord(0, 5, finish_reason="abort", stopped=True, **done)
    run.records["n"] = RequestRecord(0, 5, **done)                  # no final output came
    run.tokens, run.done = 40, 16
    s = run.summary()
    assert s["requests"] == 16 and s["completed"] == 10 and s["aborted"] == 1
    assert s["errors"] == {"engine_error": 1, "abort": 1, "engine_unreachable": 1,
                           "error_event": 1, "no_final_output": 1}
    assert s["failed"] == 5 and s["completed"] + s["failed"] + s["aborted"] == s["requests"]
    assert s["error_examples"]["engine_error"] == "too long"
    assert s["ttft_s"]["p50"] == pytest.approx(0.55) and s["itl_s"]["p99"] == pytest.approx(0.01)
    assert s["tok_per_s"] == 20.0 and s["req_per_s"] == 5.0     # completed requests per second
    text = format_summary(s)
    assert "requests     16 (10 completed, 5 failed, 1 aborted on stop) in 2.00 s" in text
    assert "errors       engine_error 1, abort 1, engine_unreachable 1, error_event 1, " \
           "no_final_output 1" in text and "  engine_error: too long" in text


def test_a_run_stopped_early_says_how_many_of_how_many_were_sent():
    run = LoadRun()
    run.planned = 12
    for i in range(4):
        run.records[str(i)] = RequestRecord(0, 5, finish_reason="error", ended=True,
                                            error="engine unreachable: nothing heard")
    text = format_summary(run.summary())
    assert "requests     4 of 12 (0 completed, 4 failed)" in text


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
    deadline = time.monotonic() + 60      # the load under way: sent, in flight, streaming
    while time.monotonic() < deadline:
        p = t.run_state.progress()
        if p["sent"] >= 3 and p["in_flight"] > 0 and p["tokens"] > 0:
            break
        time.sleep(0.05)
    assert p["sent"] >= 3 and p["in_flight"] > 0 and p["tokens"] > 0
    t.stop()
    assert not t.is_alive() and t.error is None
    # Promptly = without waiting for the in-flight requests (200 tokens each) to finish: they
    # were aborted (not all finished), and stop returned with the thread gone.
    s = t.run_state.summary()
    assert s["aborted"] >= 1 and s["requests"] >= p["sent"]
    assert s["errors"] == {}, "the load's own aborts are not failures"
    assert s["completed"] + s["aborted"] == s["requests"]


@pytest.mark.proc
@pytest.mark.slow
def test_a_load_whose_engine_dies_says_the_same_count_in_its_summary_and_its_last_line(
        tmp_path):
    """The summary's request count is the one the stop line gives ("stopped after N of 12"),
    and every one of them is either completed or failed, by kind."""
    from support.live_engine import ipc_endpoints, load_with_engine_killed
    from vconsole.engine.launch.engine_process import EngineProcess

    eps = ipc_endpoints(tmp_path)
    args = ["--num-kv-blocks", "1200", "--block-size", "8", "--set", "client_heartbeat_s=0.2",
            "--no-supervisor"]
    with EngineProcess(args, endpoints=eps) as engine:
        code, out, err = load_with_engine_killed(
            eps, engine.pid, ["--num", "12", "--concurrency", "4", "--prompt-len", "4:8",
                              "--output-len", "1500:2000", "--wait", "5", "--json"])
    assert code == 1, (out, err)
    s = json.loads(out)
    stopped = re.search(r"stopped after (\d+) of 12 requests: engine unreachable", err)
    assert stopped, err
    assert s["requests"] == int(stopped.group(1)) and s["planned"] == 12, (s, err)
    assert s["completed"] + s["failed"] == s["requests"] and s["failed"] >= 1, s
    assert set(s["errors"]) <= {"engine_unreachable", "abort"}, s
    assert s["errors"].get("engine_unreachable", 0) >= 1, s
