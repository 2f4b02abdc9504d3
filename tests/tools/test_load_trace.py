"""`vconsole load --trace FILE`: a recorded trace replayed against a live engine, over its
socket and over `vconsole serve`'s HTTP, on the trace's arrivals, with its prompt lengths,
shared prefixes, exact output lengths and priorities; and what it refuses, before sending
anything."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from support.live_engine import Telemetry
from support.serve_process import serve, status, wait_until
from vconsole.cli import build_parser
from vconsole.commands.load import main as load_main
from vconsole.telemetry.request_trace import (
    RequestRecord,
    Trace,
    TraceError,
    TraceHeader,
    prompt_block_hashes,
    read_trace,
    write_trace,
)
from vconsole.tools.trace_replay import plan_replay

BLOCK = 8                  # the trace's block size: its hashes cover blocks of 8 tokens
PREFIX_TOKENS = 2 * BLOCK  # what the sharing requests have in common
TINY = {"model": "tiny", "vocab_size": 259, "max_model_len": 2048}


def make_trace(path: Path, model: str = "tiny") -> Trace:
    """12 requests that finished, arriving every 0.125 s (1.375 s in all): the even ones share
    a 2-block prefix, priorities 0-2; and two that a replay leaves out: one aborted, one whose
    prompt + output is beyond tiny's 2,048 tokens."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)]
    records = []
    for i in range(12):
        tail = [rng.randrange(3, 250) for _ in range(rng.randint(5, 14))]
        ids = prefix + tail if i % 2 == 0 else [rng.randrange(3, 250)
                                                for _ in range(rng.randint(10, 30))]
        out = 3 + i % 6
        records.append(RequestRecord(
            arrival=0.125 * i, finish=0.125 * i + 0.1, prompt_len=len(ids), output_len=out,
            max_tokens=out, block_hashes=prompt_block_hashes(ids, BLOCK), ignore_eos=True,
            priority=i % 3, finish_reason="length"))
    records.append(RequestRecord(arrival=0.3, finish=0.4, prompt_len=20, output_len=2,
                                 max_tokens=50, finish_reason="abort"))
    records.append(RequestRecord(arrival=0.6, finish=0.7, prompt_len=2040, output_len=16,
                                 max_tokens=16, ignore_eos=True))
    trace = Trace(TraceHeader(model=model, block_size=BLOCK, num_kv_blocks=64, vocab_size=259,
                              max_model_len=2048), requests=records)
    write_trace(trace, path)
    return trace


def replayed_tokens(trace: Trace) -> int:
    return sum(r.output_len for r in trace.requests
               if r.finish_reason == "length" and r.prompt_len < 2000)


# --- the plan: what is sent, when ----------------------------------------------------------

def test_the_plan_keeps_the_trace_s_arrivals_lengths_prefixes_and_priorities(tmp_path):
    trace = make_trace(tmp_path / "t.jsonl")
    plan = plan_replay(read_trace(tmp_path / "t.jsonl"), TINY, speed=2.0)
    sent = plan.requests
    assert len(sent) == 12 and plan.skipped == {"not_finished": 1, "too_long": 1}
    kept = [r for r in trace.requests if r.finish_reason == "length" and r.prompt_len < 2000]
    assert [r.at for r in sent] == pytest.approx([r.arrival / 2 for r in kept])
    assert plan.span_s == pytest.approx(1.375 / 2)
    assert [len(r.prompt_token_ids) for r in sent] == [r.prompt_len for r in kept]
    assert [r.max_tokens for r in sent] == [r.output_len for r in kept]
    assert [r.priority for r in sent] == [r.priority for r in kept]
    assert all(0 <= t < 259 for r in sent for t in r.prompt_token_ids)   # in the vocabulary
    # Prompts share their first 16 tokens exactly where the recorded hashes were equal.
    heads = [tuple(r.prompt_token_ids[:PREFIX_TOKENS]) for r in sent]
    assert len({heads[i] for i in range(0, 12, 2)}) == 1
    assert len({heads[i] for i in range(1, 12, 2)} | {heads[0]}) == 7
    assert len({tuple(r.prompt_token_ids[:PREFIX_TOKENS + BLOCK]) for r in sent[::2]
                if len(r.prompt_token_ids) >= PREFIX_TOKENS + BLOCK}) == \
        sum(len(r.prompt_token_ids) >= PREFIX_TOKENS + BLOCK for r in sent[::2])


def test_a_trace_from_another_model_or_with_nothing_left_is_refused(tmp_path):
    make_trace(tmp_path / "t.jsonl", model="smollm2")
    with pytest.raises(TraceError, match="'smollm2', not 'tiny'"):
        plan_replay(read_trace(tmp_path / "t.jsonl"), TINY)
    make_trace(tmp_path / "t.jsonl")
    with pytest.raises(TraceError, match="nothing to replay: all 14 requests are left out"):
        plan_replay(read_trace(tmp_path / "t.jsonl"), {**TINY, "max_model_len": 8})


# --- the command's refusals: exit 2, a reason, nothing sent ------------------------------------

def _load(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = load_main(build_parser().parse_args(["load", *argv]))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extra, named", [
    (["--num", "10"], "--num"),
    (["--rate", "4", "--prompt-len", "8:16"], "--rate, --prompt-len"),
    (["--prompts", "chat"], "--prompts"),
])
def test_trace_with_a_synthetic_workload_flag_is_refused(tmp_path, capsys, extra, named):
    make_trace(tmp_path / "t.jsonl")
    code, out, err = _load(["--trace", str(tmp_path / "t.jsonl"), *extra,
                            "--input", f"ipc://{tmp_path}/none"], capsys)
    assert code == 2 and out == ""
    assert f"cannot be combined with {named}" in err


def test_speed_without_a_trace_or_not_positive_is_refused(tmp_path, capsys):
    code, _, err = _load(["--speed", "2"], capsys)
    assert code == 2 and "--speed applies to a replayed trace" in err
    make_trace(tmp_path / "t.jsonl")
    code, _, err = _load(["--trace", str(tmp_path / "t.jsonl"), "--speed", "0"], capsys)
    assert code == 2 and "--speed must be a number > 0" in err


@pytest.mark.parametrize("content, reason", [
    ("", "is empty"),
    ('{"kind": "header", "version": 1, "model": "tiny", "block_size": 8, "num_kv_blocks": 64}\n'
     '{"kind": "request", "arrival": 0.1, "fin', "cut short"),
])
def test_an_empty_or_truncated_trace_is_refused_before_connecting(tmp_path, capsys, content,
                                                                  reason):
    (tmp_path / "t.jsonl").write_text(content)
    # No engine at these endpoints: the refusal comes first, without waiting for one.
    code, out, err = _load(["--trace", str(tmp_path / "t.jsonl"), "--input",
                            f"ipc://{tmp_path}/i", "--output", f"ipc://{tmp_path}/o",
                            "--wait", "30"], capsys)
    assert code == 2 and out == "" and reason in err


# --- against a live engine ---------------------------------------------------------------------

def _check_replay(s: dict[str, Any], trace: Trace, speed: float, path: Path) -> None:
    """Every request replayed completed with exactly its output length (the engine never
    exceeds max_tokens, so equal sums mean each is exact), on the trace's arrivals."""
    assert s["errors"] == {} and s["failed"] == 0, s
    assert s["requests"] == s["completed"] == 12
    assert s["output_tokens"] == replayed_tokens(trace)
    assert s["duration_s"] >= 1.375 / speed
    t = s["trace"]
    assert t["file"] == str(path) and t["speed"] == speed
    assert (t["requests"], t["planned"], t["replayed"], t["skipped"]) == (14, 12, 12, 2)
    assert t["skipped_by_reason"] == {"not_finished": 1, "too_long": 1}
    assert t["arrival_span_s"] == pytest.approx(1.375 / speed)
    assert {"tok_per_s", "ttft_s", "itl_s"} <= set(s) and s["ttft_s"]["p50"] > 0


@pytest.mark.proc
def test_a_trace_replays_through_the_engine_client_with_prefix_cache_hits(shared_engine,
                                                                         tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    trace = make_trace(path)
    eps = shared_engine.endpoints
    code, out, err = _load(["--trace", str(path), "--input", eps["input"], "--output",
                            eps["output"], "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)
    _check_replay(s, trace, 1.0, path)
    # Each of the five later requests that share the first's 2-block prefix found it cached.
    assert s["cached_tokens"] >= 5 * PREFIX_TOKENS, s


@pytest.mark.proc
def test_a_trace_from_another_model_is_refused_naming_both(shared_engine, tmp_path, capsys):
    make_trace(tmp_path / "t.jsonl", model="smollm2")
    eps = shared_engine.endpoints
    code, out, err = _load(["--trace", str(tmp_path / "t.jsonl"), "--input", eps["input"],
                            "--output", eps["output"], "--json"], capsys)
    assert code == 2 and out == ""
    assert "'smollm2'" in err and "'tiny'" in err


@pytest.mark.proc
def test_a_public_csv_trace_replays(shared_engine, tmp_path, capsys):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,24,5\n"
                    "2023-11-16 18:15:46.8805900,40,3\n"
                    "2023-11-16 18:15:46.9805900,0,4\n"            # no prompt: not a request
                    "2023-11-16 18:15:47.1805900,12,7\n")
    eps = shared_engine.endpoints
    code, out, err = _load(["--trace", str(path), "--input", eps["input"], "--output",
                            eps["output"], "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)
    assert s["completed"] == 3 and s["output_tokens"] == 15 and s["duration_s"] >= 0.5
    assert s["trace"]["source"] == "csv" and s["trace"]["replayed"] == 3


@pytest.mark.proc
def test_a_trace_replays_over_http_through_vconsole_serve(shared_engine, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    trace = make_trace(path)
    telemetry = Telemetry(shared_engine.endpoints["telemetry"])
    child, port, log = serve(tmp_path, "--engine-ready-file", str(shared_engine.ready_path))
    try:
        wait_until(lambda: status(port) == 200, "the server never became healthy", log)
        before = telemetry.wait_for("kv", lambda _: True)["prefix_hits"]
        code, out, err = _load(["--trace", str(path), "--api-url", f"http://127.0.0.1:{port}",
                                "--speed", "2", "--json"], capsys)
        assert code == 0, err
        s = json.loads(out)
        _check_replay(s, trace, 2.0, path)
        assert s["cached_tokens"] is None       # an OpenAI usage block does not say
        # The engine's own count: the five later sharers hit the prefix cache.
        telemetry.wait_for("kv", lambda kv: kv["prefix_hits"] - before >= 5 * PREFIX_TOKENS)
    finally:
        child.stop(30, signal.SIGINT)
        telemetry.close()
