"""Recording format: write/read roundtrip, truncated tails, headers; `vconsole record` live."""

import argparse
import struct
import time

import numpy as np
import pytest
import zmq

from vconsole.commands.record import main as main_record
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.telemetry import record
from vconsole.telemetry.record import Recorder, RecordFormatError, read_records
from vconsole.telemetry.schema import SchemaVersionError, decode, encode, make_envelope


def kv_frames(seq):
    states = np.arange(300_000, dtype=np.uint8) % 4
    return encode("kv", {**make_envelope("e", 0, seq, 1.0), "block_states": states})


def test_roundtrip_keeps_frames_and_times(tmp_path):
    path = tmp_path / "t.vcrec"
    written = [kv_frames(i) for i in range(3)] + [[b"health", b"\x80"], [b"x"]]
    with Recorder(path) as rec:
        for i, frames in enumerate(written):
            rec.write(frames, ts=1000.0 + i)
        assert rec.count == 5
    got = list(read_records(path))
    assert [ts for ts, _ in got] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    for (_, frames), want in zip(got, written, strict=True):
        assert frames == [bytes(f) for f in want]
    msg = decode(got[2][1])
    assert msg.seq == 2 and msg.block_states()[5] == 1


def test_truncated_tail_is_dropped_not_fatal(tmp_path):
    path = tmp_path / "t.vcrec"
    with Recorder(path) as rec:
        rec.write([b"health", b"abc"], ts=1.0)
        rec.write(kv_frames(0))
    data = path.read_bytes()
    path.write_bytes(data[:-1000])  # a writer killed mid-record
    assert [ts for ts, _ in read_records(path)] == [1.0]


def test_bad_files_are_refused_with_a_reason(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a recording at all")
    with pytest.raises(RecordFormatError, match="bad magic"):
        list(read_records(bad))
    old = tmp_path / "old"
    old.write_bytes(struct.pack("<8sHH", record.MAGIC, record.FORMAT_VERSION, 99))
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        list(read_records(old))
    assert list(read_records(old, check_version=False)) == []


def test_vconsole_record_writes_the_live_stream(tmp_path, capsys):
    ctx = zmq.Context()
    cfg = EngineConfig(heartbeat_interval_s=0.1, config_interval_s=0.3)
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-0", 0, cfg)
    pub.start()
    path = tmp_path / "live.vcrec"
    try:
        t0 = time.monotonic()
        rc = main_record(argparse.Namespace(file=str(path), telemetry=pub.endpoint,
                                            duration=1.4))
        assert time.monotonic() - t0 >= 1.3   # it recorded for its whole duration
    finally:
        pub.close()
        ctx.destroy(linger=0)
    assert rc == 0
    msgs = [decode(frames) for _, frames in read_records(path)]
    topics = [m.topic for m in msgs]
    assert topics.count("health") >= 5 and "config" in topics and "host" in topics
    out = capsys.readouterr().out
    assert f"recorded {len(msgs)} messages" in out
