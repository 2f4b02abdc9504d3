"""The telemetry reader threads: a live SUB socket against a real PUB, and file replay."""

from __future__ import annotations

import time

import pytest
import zmq

from support.synthetic import generate, write_recording
from vconsole.console.sources.stream import ReplaySource, ZmqSource
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
        # The reader tees a burst's raw frames as it receives them and folds the burst in
        # after: under load the whole stream is one burst, recorded before it is folded in.
        wait_for(lambda: (e := state.engine()) is not None and "sched" in e.latest
                 and e.block_states is not None)
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


def test_a_burst_decodes_only_the_newest_sched_of_each_rank_and_counts_no_loss():
    """A console that fell behind catches up with one snapshot decode per engine rank; the
    skipped snapshots' ``seq`` count as seen, so nothing reads as lost."""
    from support.console_testing import frames

    def sched(rank: int, seq: int) -> list[bytes]:
        body = {"num_waiting": seq, "requests": [{"id": f"r{seq}", "state": "waiting",
                "priority": 0, "num_prompt_tokens": 1, "num_output_tokens": 0,
                "num_blocks": 0, "age_s": 0.0}]}
        return frames("sched", body, seq=seq, rank=rank)

    state = ConsoleState()
    src = ZmqSource(["tcp://127.0.0.1:1"])
    wakes: list[int] = []
    src.on_data = lambda: wakes.append(state.messages)
    health = frames("health", {"state": "running", "uptime_s": 1.0, "steps": 1,
                               "interval_s": 1.0})
    src._ingest_batch(state, [(1.0, sched(0, 0)), (1.0, sched(1, 0))])
    burst = [sched(0, 1), health, sched(1, 1), sched(0, 2), sched(0, 3), sched(1, 2)]
    src._ingest_batch(state, [(2.0, f) for f in burst])
    assert wakes == [2, 5]                  # one wake-up per batch, after it is folded in
    assert src.conflated == 3               # r0 seq 1 and 2, r1 seq 1: never decoded
    e0, e1 = state.engine("tiny-0/0"), state.engine("tiny-0/1")
    assert e0.latest["sched"]["num_waiting"] == 3 and e1.latest["sched"]["num_waiting"] == 2
    assert [r["id"] for r in e0.latest["sched"]["requests"]] == ["r3"]
    assert e0.dropped == e1.dropped == 0 and e0.skipped == 2 and e1.skipped == 1
    src._ingest_batch(state, [(3.0, sched(0, 5))])       # a real gap still counts
    assert e0.dropped == 1
