"""The ready file: written whole or not at all, versioned, removed only by the engine that wrote
it; a launcher finds a live engine through it (not through its log)."""

import json
import os
import signal

import pytest

from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire.control_client import ControlClient
from vconsole.wire.ready_file import (
    ReadyFileError,
    read_ready_file,
    ready_record,
    remove_ready_file,
    write_ready_file,
)

EPS = {"input": "tcp://127.0.0.1:1", "output": "tcp://127.0.0.1:2",
       "telemetry": "tcp://127.0.0.1:3", "control": "tcp://127.0.0.1:4"}


def test_a_written_record_reads_back_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "run" / "ready.json"
    rec = ready_record(engine_id="e0", pid=123, endpoints=EPS, control_key_file="/k",
                       model="tiny")
    write_ready_file(path, rec)
    assert read_ready_file(path) == rec
    assert os.listdir(path.parent) == ["ready.json"]
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_missing_file_is_not_ready_and_a_foreign_one_is_refused(tmp_path):
    path = tmp_path / "ready.json"
    assert read_ready_file(path) is None
    for body in ("{not json", "[]", json.dumps({"v": 2, "pid": 1, "endpoints": EPS}),
                 json.dumps({"v": True, "pid": 1, "endpoints": EPS}),
                 json.dumps({"v": 1, "pid": 1, "endpoints": {"input": "x"}}),
                 json.dumps({"v": 1, "pid": "1", "endpoints": EPS})):
        path.write_text(body)
        with pytest.raises(ReadyFileError):
            read_ready_file(path)


def test_a_record_without_every_endpoint_cannot_be_made():
    with pytest.raises(ValueError, match="control"):
        ready_record(engine_id="e", pid=1, endpoints={k: v for k, v in EPS.items()
                                                      if k != "control"}, control_key_file="k")


def test_only_the_writer_removes_its_record(tmp_path):
    path = tmp_path / "ready.json"
    write_ready_file(path, ready_record(engine_id="e", pid=10, endpoints=EPS,
                                        control_key_file="k"))
    assert not remove_ready_file(path, pid=11) and path.exists()
    assert remove_ready_file(path, pid=10) and not path.exists()
    assert not remove_ready_file(path, pid=10)


@pytest.mark.proc
def test_a_launcher_finds_a_live_engine_by_its_ready_file_alone(tmp_path):
    """``*`` ports resolved, the key file named, a request served through the announced
    endpoints; the file is gone after a clean stop."""
    engine = EngineProcess(["--model", "tiny", "--num-kv-blocks", "32"],
                           log_path=tmp_path / "engine.log")
    with engine:
        rec = read_ready_file(engine.ready_path)
        assert rec is not None and rec["pid"] == engine.pid
        assert rec["endpoints"] == engine.endpoints
        assert all(not ep.endswith(":*") for ep in rec["endpoints"].values())
        assert rec["block_size"] > 0 and rec["num_kv_blocks"] == 32
        with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
            out = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
        assert len(out.output_token_ids) == 3 and out.finish_reason == "length"
        key = engine.control_key()
        assert key is not None and str(engine.control_key_file) == rec["control_key_file"]
        with ControlClient(engine.endpoints["control"], key=key) as ctl:
            assert ctl.set_config({"max_num_seqs": 8})["ok"]
        ready_path = engine.ready_path
        engine.signal(signal.SIGTERM)
        engine.child.wait(30)
        assert engine.child.returncode == 0
        assert not ready_path.exists(), "the ready file outlived a clean stop"
