"""The request trace of a live engine (`vconsole engine --request-trace FILE`, the tiny model):
the file, ``get_trace`` over the control socket, the hot ``request_trace`` key, `vconsole
trace` and `vconsole record`'s trace beside its recording.

One engine serves the module (tests run in file order: the later ones change its trace file).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from support.live_engine import ipc_endpoints
from vconsole.cli import build_parser
from vconsole.commands import record as record_cmd
from vconsole.commands import trace as trace_cmd
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry.request_trace import Trace, TraceError, parse_lines, read_trace
from vconsole.wire.control_client import ControlClient

# One worker runs the whole module: its tests share the engine and read what earlier ones wrote
# into its trace (the hot-key test reads the start-up file the first test filled).
pytestmark = [pytest.mark.proc, pytest.mark.slow, pytest.mark.xdist_group("request-trace-live")]

BLOCK = 8
SHARED = [(5 * j) % 200 + 20 for j in range(5 * BLOCK)]         # five blocks in common
# (prompt, max_tokens): the first two share SHARED and differ in their sixth block; every
# request is told apart by its (prompt length, max_tokens).
WORK = [(SHARED + [201] * 9, 6), (SHARED + [202] * 9, 7), ([9] * 20, 5), ([11, 12, 13], 8),
        ([30 + j for j in range(17)], 4)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("request-trace")
    args = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", str(BLOCK),
            "--max-num-seqs", "4", "--request-trace", str(d / "trace.jsonl")]
    with EngineProcess(args, endpoints=ipc_endpoints(d), log_path=d / "engine.log") as proc:
        proc.trace_dir = d
        yield proc


def run(engine: EngineProcess, work: list[tuple[list[int], int]]) -> dict[tuple[int, int], int]:
    """Submit ``work`` at once and wait; output lengths by (prompt length, max_tokens)."""
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
        ids = {client.submit(prompt_token_ids=p, max_tokens=n, ignore_eos=True): (len(p), n)
               for p, n in work}
        done = client.gather(timeout_s=60)
    assert all(c.finish_reason == "length" for c in done.values())
    return {ids[rid]: len(c.output_token_ids) for rid, c in done.items()}


def wait_trace(path: Path, num_requests: int, timeout_s: float = 10.0) -> Trace:
    """The file once it holds ``num_requests`` requests (the trace thread writes a few times
    a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            trace = read_trace(path)
            if len(trace.requests) >= num_requests:
                return trace
        except TraceError:
            pass
        assert time.monotonic() < deadline, f"{path} never held {num_requests} requests"
        time.sleep(0.1)


def records(trace: Trace) -> dict[tuple[int, int], dict]:
    return {(r.prompt_len, r.max_tokens): dataclasses.asdict(r) for r in trace.requests}


def test_the_trace_file_holds_every_request_and_the_steps_that_computed_them(engine):
    outputs = run(engine, WORK)
    trace = wait_trace(engine.trace_dir / "trace.jsonl", len(WORK))
    assert (trace.header.model, trace.header.block_size) == ("tiny", BLOCK)
    assert trace.header.num_kv_blocks == 64 and trace.header.vocab_size
    by_dtype = trace.header.kv_bytes_per_token_by_dtype
    assert by_dtype["auto"] == trace.header.kv_bytes_per_token > by_dtype["int8_per_token_head"]
    assert trace.header.config["request_trace"].endswith("trace.jsonl")
    by_key = {(r.prompt_len, r.max_tokens): r for r in trace.requests}
    assert len(trace.requests) == len(WORK) and set(by_key) == set(outputs)
    for key, r in by_key.items():
        assert r.output_len == outputs[key] == key[1] and r.finish_reason == "length"
        assert r.ignore_eos and len(r.itl_us) == r.output_len - 1
        assert r.first_token is not None and r.arrival <= r.first_token <= r.finish
        assert len(r.block_hashes) == r.prompt_len // BLOCK
    a, b = by_key[(len(WORK[0][0]), WORK[0][1])], by_key[(len(WORK[1][0]), WORK[1][1])]
    assert a.block_hashes[:5] == b.block_hashes[:5] and a.block_hashes[5] != b.block_hashes[5]
    # Every token the model computed is in a step: the prompts (less prefix-cache hits) and
    # every output token but the last, which was sampled and never fed back.
    computed = sum(r.prompt_len - r.num_cached_tokens + r.output_len - 1 for r in trace.requests)
    assert sum(s.prefill + s.decode for s in trace.steps) == computed
    assert sum(s.finished for s in trace.steps) == len(WORK)
    chained = [s for s in trace.steps if s.period is not None]
    assert chained and all(s.period >= s.dur for s in chained)
    assert trace.steps[-1].period is None and trace.steps[-1].running == 0
    assert max(s.kv_used for s in trace.steps) > 0 and any(s.new_reqs for s in trace.steps)


def test_get_trace_over_control_returns_the_same_requests(engine, tmp_path):
    with ControlClient(engine.endpoints["control"]) as ctl:
        live = parse_lines(ctl.get_trace().splitlines(keepends=True))
        recent = ctl.get_trace(window_s=1e-3)
    assert records(live) == records(read_trace(engine.trace_dir / "trace.jsonl"))
    assert live.header.started_unix > 0 and '"kind":"request"' not in recent
    out = tmp_path / "cli.jsonl"
    args = build_parser().parse_args(["trace", "--out", str(out),
                                      "--control", engine.endpoints["control"]])
    assert trace_cmd.main(args) == 0
    assert records(read_trace(out)) == records(live)


def test_the_hot_key_turns_the_file_on_and_off_and_a_bad_path_is_refused(engine, tmp_path):
    path = tmp_path / "hot.jsonl"
    with ControlClient(engine.endpoints["control"], key=engine.control_key()) as ctl:
        bad = ctl.set_config({"request_trace": str(tmp_path / "no" / "such" / "dir.jsonl"),
                              "max_num_seqs": 3})
        assert not bad["ok"] and bad["values"]["max_num_seqs"] == 4
        assert "cannot write the request trace" in bad["rejected"]["request_trace"]
        assert "No such file" in bad["rejected"]["request_trace"]
        on = ctl.set_config({"request_trace": str(path)})
        assert on["ok"] and on["applied"] == {"request_trace": str(path)}
        outputs = run(engine, WORK[2:4])
        off = ctl.set_config({"request_trace": "none"})
        assert off["ok"] and off["values"]["request_trace"] is None
    trace = wait_trace(path, 2)
    assert {(r.prompt_len, r.max_tokens): r.output_len for r in trace.requests} == outputs
    assert trace.header.config_version == on["version"]
    assert trace.header.config["request_trace"] == str(path)
    assert all(r.config_version == on["version"] for r in trace.requests)
    first = read_trace(engine.trace_dir / "trace.jsonl")        # closed when the key changed
    assert len(first.requests) == len(WORK)


def test_a_trace_cut_mid_line_is_refused(engine, tmp_path):
    data = (engine.trace_dir / "trace.jsonl").read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[:-10])
    with pytest.raises(TraceError, match="cut short"):
        read_trace(cut)
    assert "request trace: a record could not be made" not in engine.log_text()


def test_record_writes_the_engines_trace_beside_the_recording(engine, tmp_path, capsys):
    rec = tmp_path / "run.vrec"
    eps = engine.endpoints
    args = build_parser().parse_args(["record", str(rec), "--duration", "2.5", "--telemetry",
                                      eps["telemetry"], "--control", eps["control"]])
    def load_once_recording() -> None:      # the recording has begun once its file exists
        deadline = time.monotonic() + 30
        while not rec.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        run(engine, WORK[3:5])

    load = threading.Thread(target=load_once_recording)
    load.start()
    assert record_cmd.main(args) == 0
    load.join()
    trace = read_trace(tmp_path / "run.vrec.trace.jsonl")
    assert {(r.prompt_len, r.max_tokens) for r in trace.requests} >= {
        (len(p), n) for p, n in WORK[3:5]}
    assert "request trace:" in capsys.readouterr().out
    # An engine that does not answer on --control: a note, and the recording still stands.
    args = build_parser().parse_args(["record", str(tmp_path / "alone.vrec"), "--duration",
                                      "3", "--telemetry", eps["telemetry"], "--control",
                                      f"ipc://{tmp_path}/nobody"])
    assert record_cmd.main(args) == 0
    assert "note: no request trace" in capsys.readouterr().err
    assert not (tmp_path / "alone.vrec.trace.jsonl").exists()
    # Another engine's telemetry without its --control: the default control endpoint may be
    # a different engine, so no trace is fetched from it.
    args = build_parser().parse_args(["record", str(tmp_path / "other.vrec"), "--duration",
                                      "3", "--telemetry", eps["telemetry"]])
    assert record_cmd.main(args) == 0
    assert "give --control" in capsys.readouterr().err
    assert not (tmp_path / "other.vrec.trace.jsonl").exists()


def test_an_engine_whose_trace_file_cannot_be_written_does_not_start(tmp_path):
    proc = EngineProcess(["--model", "tiny", "--request-trace",
                          str(tmp_path / "missing" / "trace.jsonl")],
                         endpoints=ipc_endpoints(tmp_path), log_path=tmp_path / "engine.log")
    with pytest.raises(RuntimeError, match="exited with code 2"):
        proc.start(timeout_s=60)
    assert "cannot write the request trace to" in proc.log_text()
