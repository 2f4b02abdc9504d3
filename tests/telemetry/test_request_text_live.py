"""Request text from a live engine (the tiny random-weight model: its output is noise bytes,
ESC and NUL included): published with ``--set publish_request_text=true``, absent by default,
and refused on a telemetry socket beyond loopback without CURVE — at start (a warning, the key
turned off) and by ``vconsole set`` (rejected, naming why)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import zmq

from support.live_engine import Telemetry, ipc_endpoints
from vconsole.cli import build_parser
from vconsole.commands import top
from vconsole.commands.control import main_get, main_set
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry import request_text
from vconsole.telemetry.printable import printable
from vconsole.telemetry.request_text import OUTPUT_TAIL_CHARS, PROMPT_HEAD_CHARS

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ARGS = ["--model", "tiny", "--num-kv-blocks", "128", "--block-size", "8", "--max-num-seqs", "4",
        "--set", "telemetry_hz=50", "--set", "heartbeat_interval_s=0.25",
        "--set", "publish_request_text=true"]
PROMPT = "What is the capital of France? " * 10       # 310 characters, one token a byte


def _free_port() -> int:
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        return sock.bind_to_random_port("tcp://127.0.0.1")
    finally:
        sock.close(0)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines, one after the other (a child's parent-death signal is tied to the thread
    that started it, so not from a pool): text published on ipc://, and text asked for on a
    telemetry socket beyond loopback without CURVE."""
    d, r = tmp_path_factory.mktemp("request-text"), tmp_path_factory.mktemp("refused")
    remote = {**ipc_endpoints(r), "telemetry": f"tcp://0.0.0.0:{_free_port()}"}
    procs = [EngineProcess(ARGS, endpoints=ipc_endpoints(d), log_path=d / "engine.log"),
             EngineProcess(["--model", "tiny", "--num-kv-blocks", "16", "--max-num-seqs", "2",
                            "--allow-remote-telemetry", "--set", "publish_request_text=true"],
                           endpoints=remote, log_path=r / "engine.log")]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:     # both drain at once
            p.signal(signal.SIGTERM)
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def engine(engines):
    return engines[0]


@pytest.fixture(scope="module")
def telemetry(engine):
    t = Telemetry(engine.endpoints["telemetry"])
    yield t
    t.close()


def client(engine) -> EngineClient:
    return EngineClient(engine.endpoints["input"], engine.endpoints["output"]).connect()


def texts_of(telemetry: Telemetry, rid_suffix: str, since: float) -> list[request_text.RequestText]:
    out = []
    for body in telemetry.topic("sched", since):
        for rid in body.get(request_text.FIELD) or {}:
            if rid.endswith(rid_suffix):
                text = request_text.text_of(body, rid)
                assert text is not None
                out.append(text)
    return out


def test_a_subscriber_sees_each_requests_prompt_head_and_growing_output_tail(engine, telemetry):
    since = time.monotonic()
    with client(engine) as c:
        done = c.generate(PROMPT, max_tokens=120, ignore_eos=True, timeout_s=60)
    assert done.finish_reason == "length", done.error
    time.sleep(0.3)                                 # the last snapshots before it finished
    texts = texts_of(telemetry, f":{done.request_id}", since)
    assert texts, "no sched message carried the request's text"
    assert {t.prompt_head for t in texts} == {PROMPT[:PROMPT_HEAD_CHARS]}
    tails = [t.output_tail for t in texts]
    assert len(set(tails)) >= 3, "the output tail did not follow the output as it grew"
    assert all(len(t) <= OUTPUT_TAIL_CHARS for t in tails)
    assert max(map(len, tails)) > 40                # 120 noise bytes: > 40 characters
    # Noise: what a printer must escape is really there, and printable() makes it safe.
    noisy = "".join(tails)
    assert any(ch < " " and ch not in "\n\t" for ch in noisy), "no control character at all?"
    assert not any(ch < " " for ch in printable(noisy))


def test_top_json_gives_each_row_its_text(engine, telemetry, capsys):
    with client(engine) as c:
        rid = c.submit(PROMPT, max_tokens=400, ignore_eos=True)
        try:
            telemetry.wait_for("sched", lambda b: any(
                t.output_tail for t in texts_of(telemetry, f":{rid}", 0.0)))
            code = top.main(build_parser().parse_args(
                ["top", "--once", "--json", "--telemetry", engine.endpoints["telemetry"],
                 "--control", engine.endpoints["control"]]))
        finally:
            c.abort([rid])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["sched"]["requests"]
    mine = [r for r in rows if r["id"].endswith(f":{rid}")]
    assert mine and mine[0]["prompt_head"] == PROMPT[:PROMPT_HEAD_CHARS]
    assert isinstance(mine[0]["output_tail"], str)


def test_set_off_stops_the_text_at_once(engine, telemetry):
    with client(engine) as c:
        rid = c.submit(PROMPT, request_id="off", max_tokens=200, ignore_eos=True)
        code = main_set(build_parser().parse_args(
            ["set", "--control", engine.endpoints["control"], "publish_request_text=false"]))
        assert code == 0
        since = time.monotonic() + 0.2              # what was in flight has arrived
        time.sleep(0.6)
        try:
            assert telemetry.topic("sched", since)
            assert all(request_text.FIELD not in b for b in telemetry.topic("sched", since))
        finally:
            c.abort([rid])
            main_set(build_parser().parse_args(
                ["set", "--control", engine.endpoints["control"], "publish_request_text=true"]))


def test_text_is_off_by_default(shared_engine):
    t = Telemetry(shared_engine.endpoints["telemetry"])
    try:
        since = time.monotonic()
        with EngineClient(shared_engine.endpoints["input"],
                          shared_engine.endpoints["output"]).connect() as c:
            rid = c.submit(PROMPT, max_tokens=150, ignore_eos=True)
            try:
                t.wait_for("sched", lambda b: len(b["requests"]) > 0, since=since)
            finally:
                c.abort([rid])
        assert all(request_text.FIELD not in b for b in t.topic("sched", since))
    finally:
        t.close()


def test_text_is_refused_beyond_loopback_without_curve(engines, capsys):
    proc = engines[1]
    assert "publish_request_text refused" in proc.log_text()
    assert "beyond loopback without CURVE" in proc.log_text()
    argv = ["--control", proc.endpoints["control"]]
    assert main_get(build_parser().parse_args(["get", *argv, "publish_request_text"])) == 0
    assert "false" in capsys.readouterr().out        # turned off at start
    code = main_set(build_parser().parse_args(["set", *argv, "publish_request_text=true"]))
    err = capsys.readouterr().err
    assert code == 1
    assert "rejected  publish_request_text: publish_request_text refused" in err
    assert proc.endpoints["telemetry"] in err and "CURVE" in err
