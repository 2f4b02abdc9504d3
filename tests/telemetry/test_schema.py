"""Wire formats: the telemetry schema (encode/decode, validation) and the control protocol."""

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from vconsole.engine.latency import LatencyStats
from vconsole.shared.config import EngineConfig, apply_update, describe_config
from vconsole.telemetry.schema import (
    SCHEMA_VERSION,
    TOPICS,
    SchemaError,
    SchemaVersionError,
    decode,
    encode,
    make_envelope,
    missing_fields,
)
from vconsole.wire import control
from vconsole.wire.control_client import ControlClient


def env(seq=0):
    return make_envelope("engine-0", 0, seq, time.time())


ROWS = [{"id": f"r{i}", "state": "running" if i % 2 else "waiting", "priority": i % 3,
         "num_prompt_tokens": 10 + i, "num_output_tokens": i, "num_blocks": i // 4,
         "age_s": i / 10, "constraint": i % 6, "compile_ms": i / 4} for i in range(25)]

def _latency_sample() -> dict:
    lat = LatencyStats(60.0)
    lat.observe("ttft_s", 0.25, priority=0, now=10.0)
    lat.observe("itl_s", 0.02, priority=3, now=10.0, times=4)
    lat.finish("length")
    return lat.snapshot(11.0)


SAMPLES = {
    "health": {"state": "running", "uptime_s": 12.5, "steps": 100, "interval_s": 1.0},
    "step": {"steps": 10, "window_s": 0.1, "phase_s": {"schedule": 0.001, "execute": 0.05,
             "update": 0.002}, "step_time_p50_s": 0.005, "step_time_max_s": 0.01,
             "num_prefill_tokens": 300, "num_decode_tokens": 40, "tokens_per_s": 3400.0,
             "steps_per_s": 100.0, "sched_share": 0.02},
    "sched": {"num_waiting": 3, "num_running": 22, "num_preempted": 1,
              "num_preemptions_total": 7, "num_finished_total": 99, "max_num_seqs": 64,
              "num_prompt_tokens_total": 1234, "num_generation_tokens_total": 567,
              "max_num_batched_tokens": 512, "policy": "fcfs", "requests": ROWS,
              "requests_truncated": False},
    "kv": {"num_blocks": 8, "block_size": 16, "num_free": 4, "num_used": 3, "num_cached": 1,
           "num_shared": 1, "usage": 0.375, "token_usage": 0.3, "fragmentation": 0.2,
           "prefix_queries": 100, "prefix_hits": 25, "prefix_hit_rate": 0.25,
           "block_states": np.array([0, 1, 1, 3, 2, 0, 0, 0], np.uint8),
           "cache_dtype": "int8_per_token_head", "bytes_per_token": 1088,
           "capacity_tokens": 128, "pool_bytes": 139264},
    "gpu": {"available": True, "devices": [{"index": 0, "name": "H100", "util": 55.0,
            "mem_used": 10, "mem_total": 80, "temp_c": 60, "power_w": 300.5,
            "sm_clock_mhz": 1980}], "error": None},
    "host": {"proc_cpu_percent": 99.0, "proc_rss_bytes": 1 << 30, "proc_num_threads": 9,
             "sys_cpu_percent": 40.0, "sys_mem_used": 5 << 30, "sys_mem_total": 64 << 30},
    "config": {"version": 3, "values": EngineConfig().to_dict(), "schema": describe_config()},
    "alert": {"name": "waiting", "level": "warning", "value": 60.0, "threshold": 50.0,
              "message": "waiting requests is 60"},
    "latency": _latency_sample(),
    "dp": {"world_size": 2, "wave": 3, "wave_running": True, "group_generation": 0,
           "group_state": "ok", "steps_total": 400, "dummy_steps_total": 40, "dummy_share": 0.1,
           "sync_every": 4, "sync_count_total": 100, "sync_s_total": 0.05,
           "sync_s_per_step": 0.000125},
    "wave": {"event": "complete", "wave": 3, "steps": 120, "dummy_steps": 12, "duration_s": 1.5},
}


def test_every_topic_has_a_sample_with_its_documented_fields():
    assert set(SAMPLES) == set(TOPICS)
    for topic, body in SAMPLES.items():
        assert missing_fields(topic, {**env(), **body}) == [], topic


@pytest.mark.parametrize("topic", TOPICS)
def test_roundtrip_every_topic(topic):
    payload = {**env(seq=7), **SAMPLES[topic]}
    frames = encode(topic, payload)
    assert frames[0] == topic.encode()
    msg = decode([bytes(f) for f in frames])
    assert msg.topic == topic and msg.seq == 7 and msg.engine == "engine-0" and msg.rank == 0
    assert msg.payload["v"] == SCHEMA_VERSION
    for key, want in SAMPLES[topic].items():
        got = msg.payload[key]
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(msg.array(key), want)
        else:
            assert got == want, key
    assert "v" not in SAMPLES[topic]  # encode did not mutate the caller's dict


def test_sched_requests_are_columnar_on_the_wire_and_rows_after_decode():
    frames = encode("sched", {**env(), **SAMPLES["sched"]})
    wire = msgpack.unpackb(frames[1], raw=False)["requests"]
    assert isinstance(wire, dict) and wire["id"][:2] == ["r0", "r1"]
    assert wire["age_s"]["shape"] == [25] and wire["state"]["dtype"] == "uint8"
    assert decode(frames).payload["requests"] == ROWS
    empty = decode(encode("sched", {**env(), **SAMPLES["sched"], "requests": []}))
    assert empty.payload["requests"] == []


def test_million_block_kv_is_zero_copy_on_both_ends():
    states = np.random.default_rng(0).integers(0, 4, 1 << 20, dtype=np.uint8)
    frames = encode("kv", {**env(), **SAMPLES["kv"], "num_blocks": states.size,
                           "block_states": states})
    assert len(frames) == 3 and np.shares_memory(np.frombuffer(frames[2], np.uint8), states)
    assert len(frames[1]) < 1000  # the array is not in the msgpack payload

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("tcp://127.0.0.1:*")
        b.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))
        a.send_multipart(frames, copy=False)
        assert b.poll(5000)
        received = b.recv_multipart(copy=False)
        msg = decode(received)
        got = msg.block_states()
        assert got.dtype == np.uint8 and got.shape == (1 << 20,)
        np.testing.assert_array_equal(got, states)
        assert np.shares_memory(got, np.frombuffer(received[2].buffer, np.uint8))
        assert not got.flags.writeable
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_explicit_buffers_and_numpy_scalars():
    raw = np.arange(6, dtype=np.float32).tobytes()
    payload = {**env(), "name": "x", "level": "ok", "value": np.float64(1.5),
               "threshold": np.int64(2), "message": "m",
               "extra": {"buffer": 0, "dtype": "float32", "shape": [2, 3]}}
    msg = decode(encode("alert", payload, [raw]))
    assert msg.payload["value"] == 1.5 and msg.payload["threshold"] == 2
    np.testing.assert_array_equal(msg.array("extra"), np.arange(6, dtype=np.float32).reshape(2, 3))


def good_frames(topic="health"):
    return [bytes(f) for f in encode(topic, {**env(), **SAMPLES[topic]})]


def repack(topic, **changes):
    payload = msgpack.unpackb(good_frames(topic)[1], raw=False)
    for k, v in changes.items():
        if v is None:
            payload.pop(k)
        else:
            payload[k] = v
    return [topic.encode(), msgpack.packb(payload)]


@pytest.mark.parametrize("frames,why", [
    ([b"health"], "at least 2 frames"),
    ([b"nonsense", good_frames()[1]], "unknown topic"),
    ([b"health", b"\xc1\xc1garbage"], "not valid msgpack"),
    ([b"health", msgpack.packb([1, 2, 3])], "must be a map"),
    (repack("health", v=None), "no schema version"),
    (repack("health", v="1"), "must be an integer"),
    (repack("health", engine=None), "'engine'"),
    (repack("health", ts=None), "'ts'"),
    (repack("health", seq="3"), "'seq' must be int"),
    (repack("health", rank=True), "'rank' must be int"),
])
def test_malformed_frames_raise_schema_error_with_a_reason(frames, why):
    with pytest.raises(SchemaError, match=why):
        decode(frames)


def test_bad_buffer_references():
    frames = good_frames("kv")
    with pytest.raises(SchemaError, match="references buffer 0 but the message has 0"):
        decode(frames[:2])
    with pytest.raises(SchemaError, match="bytes but buffer 0 holds"):
        decode([*frames[:2], b"\x00" * 7])
    for bad, why in [({"buffer": 5, "dtype": "uint8", "shape": [8]}, "references buffer 5"),
                     ({"buffer": 0, "dtype": "nope", "shape": [8]}, "unknown dtype"),
                     ({"buffer": 0, "dtype": None, "shape": [8]}, "unknown dtype"),
                     ({"buffer": 0, "dtype": "uint8", "shape": [-8]}, "invalid shape"),
                     ({"buffer": 0, "dtype": "uint8", "shape": "8"}, "invalid shape")]:
        f = repack("kv", block_states=bad)
        with pytest.raises(SchemaError, match=why):
            decode([*f, frames[2]])


def test_version_mismatch_names_both_versions():
    with pytest.raises(SchemaVersionError, match=f"version 99.*version {SCHEMA_VERSION}"):
        decode(repack("step", v=99))
    assert issubclass(SchemaVersionError, SchemaError)


def test_encode_refuses_what_receivers_would_reject():
    with pytest.raises(SchemaError, match="unknown topic"):
        encode("weather", env())
    with pytest.raises(SchemaError, match="'seq'"):
        encode("health", {"ts": 1.0, "engine": "e", "rank": 0})
    with pytest.raises(SchemaError, match="cannot be encoded"):
        encode("health", {**env(), "state": object()})
    with pytest.raises(SchemaError, match="only on kv"):
        decode(good_frames("health")).block_states()


# --- control protocol ---------------------------------------------------------------------

def test_control_request_and_reply_codecs():
    req = control.decode_request(control.encode_request("set_config", {"policy": "priority"},
                                                        request_id=4))
    assert req == {"op": "set_config", "values": {"policy": "priority"}, "id": 4}
    for data, why in [(b"\xc1", "not valid msgpack"), (msgpack.packb([1]), "must be a map"),
                      (msgpack.packb({"op": "reboot"}), "unknown op"),
                      (msgpack.packb({"op": "set_config"}), "needs 'values'"),
                      (msgpack.packb({"op": "get_config", "id": "x"}), "'id' must be")]:
        with pytest.raises(control.ControlError, match=why):
            control.decode_request(data)
    cfg = EngineConfig()
    update = apply_update(cfg, {"max_num_seqs": 8, "block_size": 32})
    reply = control.decode_reply(control.encode_reply(
        control.config_reply(1, update.config.to_dict(), update, request_id=4)))
    assert reply["ok"] is False and reply["restart_required"] == ["block_size"]
    assert reply["id"] == 4 and reply["values"]["max_num_seqs"] == 64 and reply["schema"]
    assert set(reply) >= {"ok", "applied", "rejected", "restart_required", "version", "values",
                          "schema", "error"}


class FakeEngineControl:
    """A ROUTER on its own thread that answers with the helpers, the way core_proc will."""

    def __init__(self, ctx, *, silent=False):
        self.cfg, self.version, self.silent = EngineConfig(), 1, silent
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def handle(self, req):
        if req["op"] == "get_config":
            return control.config_reply(self.version, self.cfg.to_dict())
        update = apply_update(self.cfg, req["values"])
        if update.applied:
            self.cfg, self.version = update.config, self.version + 1
        return control.config_reply(self.version, self.cfg.to_dict(), update)

    def serve(self):
        while not self.stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                if not self.silent:
                    self.sock.send_multipart(control.handle_frames(frames, self.handle))
        self.sock.close(0)

    def close(self):
        self.stop.set()
        self.thread.join(2)



def test_control_client_against_a_router(ctx):
    eng = FakeEngineControl(ctx)
    try:
        with ControlClient(eng.endpoint, timeout_s=3, ctx=ctx) as client:
            got = client.get_config()
            assert got["ok"] and got["version"] == 1 and got["values"]["policy"] == "fcfs"
            assert {row["key"] for row in got["schema"]} == set(got["values"])
            r = client.set_config({"policy": "priority", "max_num_seqs": "8"})
            assert r["ok"] and r["applied"] == {"policy": "priority", "max_num_seqs": 8}
            assert r["version"] == 2 and r["values"]["policy"] == "priority"
            r = client.set_config({"max_num_seqs": 0})
            assert not r["ok"] and ">= 1" in r["rejected"]["max_num_seqs"]
            r = client.set_config({"model": "other"})
            assert not r["ok"] and r["restart_required"] == ["model"]
        # A REQ client (e.g. another language's simplest client) gets the same answers.
        req = ctx.socket(zmq.REQ)
        req.connect(eng.endpoint)
        req.send(msgpack.packb({"op": "bogus"}))
        assert req.poll(3000)
        bad = control.decode_reply(req.recv())
        assert bad["ok"] is False and "unknown op" in bad["error"]
        req.close(0)
    finally:
        eng.close()


def test_control_client_times_out_clearly_and_recovers(ctx):
    eng = FakeEngineControl(ctx, silent=True)
    client = ControlClient(eng.endpoint, timeout_s=0.3, ctx=ctx)
    with pytest.raises(TimeoutError, match="no reply from the engine's control socket at tcp://"):
        client.get_config()
    eng.silent = False
    client.timeout_s = 3
    assert client.get_config()["ok"]  # same client object, fresh socket
    client.close()
    eng.close()
