"""Request text from a live engine (the tiny random-weight model: its output is noise bytes,
ESC and NUL included): published with ``--set publish_request_text=true``, absent by default,
and refused on a telemetry socket beyond loopback without CURVE — at start (a warning, the key
turned off) and by ``vconsole set`` (rejected, naming why)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time

import psutil
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

ARGS = ["--model", "tiny", "--num-kv-blocks", "256", "--block-size", "8", "--max-num-seqs", "4",
        "--set", "telemetry_hz=50", "--set", "heartbeat_interval_s=0.25",
        "--set", "publish_request_text=true"]
PROMPT = "What is the capital of France? " * 10       # 310 characters, one token a byte


def _host_address() -> str | None:
    """An IPv4 address of this host's interfaces beyond loopback (engine sockets do not enable
    IPv6), or None: a socket beyond loopback without opening one on every interface."""
    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET]
    with contextlib.suppress(OSError):
        found += [str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None,
                                                            socket.AF_INET)]
    return next((a for a in found if not a.startswith("127.")), None)


def _free_port(host: str = "127.0.0.1") -> int:
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        return sock.bind_to_random_port(f"tcp://{host}")
    finally:
        sock.close(0)


def _engine(tmp_path_factory, name: str, args: list[str], endpoints=None):
    """One engine of this module, started here and drained after the module (a child's
    parent-death signal is tied to the thread that started it, so not from a pool)."""
    d = tmp_path_factory.mktemp(name)
    proc = EngineProcess(args, endpoints=endpoints or ipc_endpoints(d), log_path=d / "engine.log")
    try:
        proc.start()
        yield proc
    finally:
        proc.signal(signal.SIGTERM)
        proc.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Text published on ipc://."""
    yield from _engine(tmp_path_factory, "request-text", ARGS)


@pytest.fixture(scope="module")
def refusing_engine(tmp_path_factory):
    """Text asked for on a telemetry socket beyond loopback without CURVE: an address of this
    host's own, not 0.0.0.0 (which would open it on every interface)."""
    host = _host_address()
    if host is None:
        pytest.skip("this host has no IPv4 address beyond loopback to bind telemetry on")
    d = tmp_path_factory.mktemp("refused-endpoints")
    remote = {**ipc_endpoints(d), "telemetry": f"tcp://{host}:{_free_port(host)}"}
    yield from _engine(tmp_path_factory, "refused",
                       ["--model", "tiny", "--num-kv-blocks", "64", "--max-num-seqs", "2",
                        "--set", "telemetry_hz=50", "--allow-remote-telemetry",
                        "--set", "publish_request_text=true"], remote)


@pytest.fixture(scope="module")
def telemetry(engine):
    t = Telemetry(engine.endpoints["telemetry"])
    yield t
    t.close()


def client(engine) -> EngineClient:
    return EngineClient(engine.endpoints["input"], engine.endpoints["output"]).connect()


def texts_of_body(body: dict, rid_suffix: str) -> list[request_text.RequestText]:
    out = []
    for rid in body.get(request_text.FIELD) or {}:
        if rid.endswith(rid_suffix):
            text = request_text.text_of(body, rid)
            assert text is not None
            out.append(text)
    return out


def texts_of(telemetry: Telemetry, rid_suffix: str, since: float) -> list[request_text.RequestText]:
    return [t for body in telemetry.topic("sched", since) for t in texts_of_body(body, rid_suffix)]


def test_a_subscriber_sees_each_requests_prompt_head_and_growing_output_tail(engine, telemetry):
    since = time.monotonic()
    with client(engine) as c:
        done = c.generate(PROMPT, max_tokens=120, ignore_eos=True, timeout_s=60)
    assert done.finish_reason == "length", done.error
    # A snapshot taken after it finished: every one before it has arrived too.
    telemetry.wait_for("sched", lambda b: True, since=time.monotonic())
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
        # As long as the pool allows, to still run while `top --once` subscribes and waits on
        # a loaded machine (400 tokens were over first once); aborted once read.
        rid = c.submit(PROMPT, max_tokens=1600, ignore_eos=True)  # 1,910 of the 2,048 slots
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
        rid = c.submit(PROMPT, request_id="off", max_tokens=600, ignore_eos=True)
        try:
            telemetry.wait_for("sched", lambda b: bool(texts_of_body(b, ":off")))
            before = time.monotonic()
            code = main_set(build_parser().parse_args(
                ["set", "--control", engine.endpoints["control"], "publish_request_text=false"]))
            assert code == 0
            # The publisher takes the change between two snapshots: from the first message
            # without text on, none has it (the request still runs, so one would).
            off = telemetry.wait_for("sched", lambda b: request_text.FIELD not in b,
                                     since=before)
            telemetry.wait_for("sched", lambda b: bool(b["requests"]), since=time.monotonic())
            sched = telemetry.topic("sched", before)
            later = sched[next(i for i, b in enumerate(sched) if b is off) + 1:]
            assert later and any(b["requests"] for b in later)
            assert all(request_text.FIELD not in b for b in later)
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


def test_text_is_refused_beyond_loopback_without_curve(refusing_engine, capsys):
    proc = refusing_engine
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
    # What matters: no sched message on that socket carries text, while a request runs.
    t = Telemetry(proc.endpoints["telemetry"])
    try:
        since = time.monotonic()
        with client(proc) as c:
            rid = c.submit(PROMPT, max_tokens=150, ignore_eos=True)
            try:
                # A few snapshots while it runs (each would carry its text).
                t.wait_for("sched", lambda b: sum(bool(x["requests"]) for x in
                                                  t.topic("sched", since)) >= 3, since=since)
            finally:
                c.abort([rid])
        sched = t.topic("sched", since)
        assert sched and all(request_text.FIELD not in b for b in sched)
    finally:
        t.close()
