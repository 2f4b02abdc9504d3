"""The telemetry reader threads: a live SUB socket against a real PUB, and file replay."""

from __future__ import annotations

import time

import pytest
import zmq

from support.synthetic import generate, write_recording
from vconsole.console.source import ReplaySource, ZmqSource
from vconsole.console.state import ConsoleState
from vconsole.telemetry.record import read_records


@pytest.fixture
def pub():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)
    ctx.term()


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_live_source_reads_in_its_thread_and_records_raw_frames(pub, tmp_path):
    sock, endpoint = pub
    recs = list(generate(duration_s=3))
    state = ConsoleState()
    src = ZmqSource([endpoint])
    src.start(state)
    try:
        it = iter(recs)
        # Slow joiner: keep publishing until the subscription is live.
        wait_for(lambda: (sock.send_multipart(next(it)[1], copy=False), state.messages)[1] > 0)
        path = tmp_path / "rec.vrec"
        src.start_recording(path)
        sent = 0
        for _ts, frames in it:
            sock.send_multipart(frames, copy=False)
            sent += 1
        wait_for(lambda: src.recorded >= sent)
        got_path, n = src.stop_recording()
        assert got_path == str(path) and n >= sent
        assert not src.recording
        replayed = list(read_records(path))
        assert len(replayed) == n
        eng = state.engine()
        assert eng is not None and eng.engine == "tiny-0" and eng.dropped == 0
        assert "sched" in eng.latest and eng.block_states is not None
    finally:
        src.stop()


def test_replay_clock_follows_the_recording(tmp_path):
    path = tmp_path / "r.vrec"
    write_recording(path, duration_s=2)
    first = next(iter(read_records(path)))[0]
    last = max(ts for ts, _ in read_records(path))
    state = ConsoleState()
    src = ReplaySource(path, speed=0)
    src.start(state)
    assert src.finished and state.now() == last
    assert state.engine().heartbeat_age(state.now()) < 1.0
    state2 = ConsoleState()
    fast = ReplaySource(path, speed=50)
    fast.start(state2)
    wait_for(lambda: fast.finished)
    assert state2.messages == state.messages
    assert state2.now() == last and last - first > 1.9
    fast.stop()


def test_replay_of_a_foreign_schema_version_is_reported(tmp_path):
    path = tmp_path / "old.vrec"
    write_recording(path, duration_s=1)
    raw = bytearray(path.read_bytes())
    raw[10:12] = (99).to_bytes(2, "little")   # header: magic, format u16, schema u16
    path.write_bytes(bytes(raw))
    state = ConsoleState()
    ReplaySource(path, speed=0).start(state)
    assert state.schema_problem() is not None and "99" in state.schema_problem()
