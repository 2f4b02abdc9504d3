"""The engine as a live process: real `vconsole engine`, real ZeroMQ sockets (ipc:// in a tmp dir).

One engine serves the whole module (starting one costs seconds on 2 cores); tests run in file
order and each leaves the engine idle. The last test shuts it down with SIGTERM.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from console.demo import EngineProcess
from engine import protocol
from engine.client import EngineClient
from telemetry import schema
from telemetry.control import ControlClient

CONFIG = """\
max_num_seqs = 4
telemetry_hz = 20.0
heartbeat_interval_s = 0.25
config_interval_s = 1.0
alert_waiting_warning = 5
"""
ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "40", "--block-size", "8",
               "--max-num-batched-tokens", "64", "--policy", "priority"]


class Telemetry:
    """Every telemetry message, decoded, from a SUB thread."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[float, str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        while not self._stop.is_set():
            if sock.poll(50):
                msg = schema.decode(sock.recv_multipart(copy=False))
                payload = dict(msg.payload)
                if msg.topic == "kv":
                    payload["block_states"] = msg.block_states().copy()
                self.messages.append((time.monotonic(), msg.topic, payload))
        sock.close(0)

    def topic(self, name: str, since: float = 0.0) -> list[dict]:
        return [p for t, topic, p in list(self.messages) if topic == name and t >= since]

    def wait_for(self, name: str, pred, timeout_s: float = 10.0, since: float = 0.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.topic(name, since):
                if pred(p):
                    return p
            time.sleep(0.05)
        raise AssertionError(f"no {name} message matched within {timeout_s} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def engine(workdir):
    cfg = workdir / "engine.toml"
    cfg.write_text(CONFIG)
    eps = {n: f"ipc://{workdir}/{n}" for n in ("input", "output", "telemetry", "control")}
    proc = EngineProcess([*ENGINE_ARGS, "--config", str(cfg)], endpoints=eps,
                         log_path=workdir / "engine.log")
    proc.start()
    proc.config_path = cfg
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def telemetry(engine):
    t = Telemetry(engine.endpoints["telemetry"])
    yield t
    t.close()


def client(engine, **kw) -> EngineClient:
    return EngineClient(engine.endpoints["input"], engine.endpoints["output"], **kw).connect()


def control(engine) -> ControlClient:
    return ControlClient(engine.endpoints["control"], timeout_s=10)


def prompts(n: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 259) for _ in range(rng.randint(3, 20))], rng.randint(1, 6),
             rng.choice([0, 0, 1, 2])) for _ in range(n)]


def reference_outputs(work: list[tuple[list[int], int, int]]) -> list[list[int]]:
    """The same prompts, greedy, through an in-process EngineCore."""
    import torch

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.request import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leave the other core to the engine process
    try:
        core = EngineCore(EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=16))
        for i, (ids, max_tokens, _) in enumerate(work):
            core.add_request(core.make_request(str(i), prompt_token_ids=ids,
                                               sampling=SamplingParams(max_tokens=max_tokens)))
        results: dict[str, list[int]] = {str(i): [] for i in range(len(work))}
        while core.has_unfinished_requests():
            outputs, _ = core.step()
            for outs in outputs.values():
                for out in outs:
                    results[out.request_id].extend(out.new_token_ids)
    finally:
        torch.set_num_threads(threads)
    return [results[str(i)] for i in range(len(work))]


def test_four_clients_200_requests_match_an_in_process_greedy_run(engine, telemetry):
    work = prompts(200)
    quarters = [list(range(k, 200, 4)) for k in range(4)]
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(indices: list[int]) -> None:
        try:
            with client(engine) as c:
                ids = {c.submit(prompt_token_ids=work[i][0], max_tokens=work[i][1],
                                priority=work[i][2]): i for i in indices}
                for rid, done in c.gather().items():
                    got[ids[rid]] = done
        except BaseException as e:
            errors.append(e)

    expected = reference_outputs(work)  # first: two torch processes on 2 cores thrash
    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(q,)) for q in quarters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(got) == 200
    for i, ref in enumerate(expected):
        done = got[i]
        assert done.finished and done.finish_reason in ("length", "stop"), done
        assert done.output_token_ids == ref, f"request {i}"
        assert done.num_prompt_tokens == len(work[i][0])

    # Telemetry agrees with the clients' view: bounded batch, queues and KV drain afterwards.
    sched = telemetry.topic("sched", since=t0)
    assert sched and max(s["num_running"] for s in sched) <= 4
    assert max(s["num_running"] + s["num_waiting"] for s in sched) > 4  # the load queued up
    telemetry.wait_for("sched", lambda s: s["num_waiting"] == 0 and s["num_running"] == 0
                       and s["num_finished_total"] >= 200, since=t0)
    telemetry.wait_for("kv", lambda k: k["num_used"] == 0 and k["num_blocks"] == 40, since=t0)
    steps = telemetry.topic("step", since=t0)
    assert sum(s["num_decode_tokens"] + s["num_prefill_tokens"] for s in steps) > 0
    telemetry.wait_for("health", lambda h: h["state"] == "idle", since=time.monotonic())
    seen = {topic for _, topic, _ in telemetry.messages}
    assert seen >= {"health", "step", "sched", "kv", "gpu", "host", "config", "alert"}


def test_gpu_topic_reports_nvml_unavailable_cleanly(telemetry):
    gpu = telemetry.wait_for("gpu", lambda g: True)
    if gpu["available"]:
        pytest.skip("this machine has a GPU")
    assert gpu["devices"] == [] and isinstance(gpu["error"], str) and gpu["error"]
    assert "Traceback" not in gpu["error"]


def test_set_max_num_seqs_mid_load_is_applied_between_steps_and_published(engine, telemetry):
    with client(engine) as c, control(engine) as ctl:
        ids = [c.submit(prompt_token_ids=[5 + i] * 6, max_tokens=16, ignore_eos=True)
               for i in range(16)]
        stream = c.stream(ids[0])
        first = next(stream)  # the load is running
        reply = ctl.set_config({"max_num_seqs": "2"})
        t_set = time.monotonic()
        assert reply["ok"] and reply["applied"] == {"max_num_seqs": 2}
        assert reply["values"]["max_num_seqs"] == 2
        rest = list(stream)
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 16
        done = c.gather(ids[1:])
        assert all(d.finish_reason == "length" and len(d.output_token_ids) == 16
                   for d in done.values())
        cfg = telemetry.wait_for("config", lambda m: m["version"] == reply["version"],
                                 since=t_set - 1)
        assert cfg["values"]["max_num_seqs"] == 2
        telemetry.wait_for("sched", lambda s: s["max_num_seqs"] == 2 and s["num_running"] == 0
                           and s["num_waiting"] == 0, since=t_set)
        sched = [s for s in telemetry.topic("sched", since=t_set) if s["max_num_seqs"] == 2]
        # Running requests finish; from the first snapshot at <= 2, it never exceeds 2 again.
        first_ok = next(i for i, s in enumerate(sched) if s["num_running"] <= 2)
        assert all(s["num_running"] <= 2 for s in sched[first_ok:])
        assert ctl.set_config({"max_num_seqs": 4})["ok"]


def test_bad_config_values_are_rejected_with_reasons_and_nothing_changes(engine):
    with control(engine) as ctl:
        before = ctl.get_config()
        reply = ctl.set_config({"max_num_seqs": "0", "policy": "random", "telemetry_hz": "5"})
        assert not reply["ok"] and not reply["applied"]
        assert ">= 1" in reply["rejected"]["max_num_seqs"]
        assert "one of" in reply["rejected"]["policy"]
        reply = ctl.set_config({"block_size": "32"})
        assert reply["restart_required"] == ["block_size"]
        after = ctl.get_config()
        assert after["version"] == before["version"] and after["values"] == before["values"]


def _rewrite_keep_mtime(path, text: str) -> None:
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _wait_value(engine, key, value, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    with control(engine) as ctl:
        while time.monotonic() < deadline:
            if ctl.get_config()["values"][key] == value:
                return
            time.sleep(0.1)
    raise AssertionError(f"{key} never became {value!r}")


def test_config_file_is_reloaded_on_sighup_and_on_change(engine):
    path = engine.config_path
    # Same size and mtime: only SIGHUP can tell the engine.
    _rewrite_keep_mtime(path, CONFIG.replace("max_num_seqs = 4", "max_num_seqs = 3"))
    time.sleep(1.5)
    with control(engine) as ctl:
        assert ctl.get_config()["values"]["max_num_seqs"] == 4
    engine.signal(signal.SIGHUP)
    _wait_value(engine, "max_num_seqs", 3)

    # An edit is noticed by itself; a restart-only key in it is reported, the hot part applied.
    time.sleep(0.05)
    path.write_text(CONFIG.replace("max_num_seqs = 4", "max_num_seqs = 5") + "block_size = 32\n")
    _wait_value(engine, "max_num_seqs", 5)
    deadline = time.monotonic() + 5
    while "block_size changed in the file: restart_required" not in engine.log_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with control(engine) as ctl:
        assert ctl.get_config()["values"]["block_size"] == 8

    # A broken file is logged and changes nothing.
    path.write_text("max_num_seqs = [oops\n")
    engine.signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while "is not valid TOML" not in engine.log_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    path.write_text(CONFIG)
    _wait_value(engine, "max_num_seqs", 4)


def test_malformed_frames_get_a_reason_and_the_engine_keeps_serving(engine):
    ctx = zmq.Context.instance()
    ident = b"raw-client"
    inp, out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (inp, out):
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 0)
    out.connect(engine.endpoints["output"])
    inp.connect(engine.endpoints["input"])

    def reply() -> dict:
        assert out.poll(10_000), "no reply"
        header = protocol.decode([f.buffer for f in out.recv_multipart(copy=False)])
        return header

    try:
        inp.send_multipart(protocol.encode_hello(), copy=False)
        assert reply()["type"] == protocol.READY
        inp.send(b"\xc1 not msgpack")
        r = reply()
        assert r["type"] == protocol.ERROR and "undecodable" in r["reason"]
        inp.send(msgpack.packb({"v": 99, "type": "add"}))
        assert "protocol version 99" in reply()["reason"]
        inp.send(msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "launch"}))
        assert "unknown message type" in reply()["reason"]
        bad = protocol.encode({"type": "add", "request_id": "bad-1", "prompt": "x",
                               "sampling": {"max_tokens": 0}})
        inp.send_multipart(bad, copy=False)
        r = reply()
        (o,) = protocol.parse_outputs(r)
        assert o.request_id == "bad-1" and o.finished and o.finish_reason == "error"
        assert "max_tokens" in o.error
        inp.send_multipart(protocol.encode_add("oov-1", prompt_token_ids=[1, 2, 100000]))
        (o,) = protocol.parse_outputs(reply())
        assert o.finish_reason == "error" and "vocabulary" in o.error
    finally:
        inp.close(0)
        out.close(0)
    with client(engine) as c:
        assert c.generate("still serving", max_tokens=3).finish_reason in ("length", "stop")
    assert "rejected a message from client raw-client" in engine.log_text()


def test_abort_finishes_a_request_and_only_its_owner_can_abort(engine):
    with client(engine) as a, client(engine) as b:
        rid = a.submit(prompt_token_ids=[7] * 5, max_tokens=250, ignore_eos=True)
        other = a.submit(prompt_token_ids=[9] * 5, max_tokens=20, ignore_eos=True)
        stream = a.stream(rid)
        assert next(stream).new_token_ids
        b.abort([other])  # not b's: ignored
        a.abort([rid])
        final = [o for o in stream][-1]
        assert final.finished and final.finish_reason == "abort"
        assert final.num_output_tokens < 250
        assert a.gather([other])[other].finish_reason == "length"


def test_duplicate_in_flight_request_id_is_rejected(engine):
    with client(engine) as a, client(engine) as b:
        a.submit(prompt_token_ids=[11] * 4, max_tokens=50, ignore_eos=True, request_id="same")
        first = next(a.stream("same"))  # in flight (two sockets: no order between a and b)
        b.submit(prompt_token_ids=[12] * 4, max_tokens=2, request_id="same")
        dup = b.gather()["same"]
        assert dup.finish_reason == "error" and "duplicate" in dup.error
        rest = a.gather()["same"]
        assert rest.finish_reason == "length"
        assert len(first.new_token_ids) + len(rest.output_token_ids) == 50


def test_a_vanished_client_has_its_requests_aborted(engine, telemetry):
    c = client(engine)
    rid = c.submit(prompt_token_ids=[13] * 4, max_tokens=250, ignore_eos=True)
    next(c.stream(rid))
    c.close()
    t = time.monotonic()
    telemetry.wait_for("sched", lambda s: s["num_running"] == 0 and s["num_waiting"] == 0,
                       since=t, timeout_s=15)
    assert "is gone: aborting its 1 request(s)" in engine.log_text()


def test_non_loopback_endpoints_are_refused_without_opt_in():
    r = subprocess.run([sys.executable, "-m", "vconsole.cli", "engine", "--input",
                        "tcp://0.0.0.0:5999"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "non-loopback" in r.stderr and "CURVE" in r.stderr


def test_steering_sockets_stay_on_loopback_even_with_the_opt_in():
    from engine.core_proc import RemoteBindRefused, check_endpoints

    check_endpoints({"telemetry": "tcp://0.0.0.0:1", "control": "ipc:///tmp/c"}, True)
    with pytest.raises(RemoteBindRefused, match="--allow-remote-telemetry"):
        check_endpoints({"telemetry": "tcp://0.0.0.0:1"}, False)
    for name in ("input", "output", "control"):
        with pytest.raises(RemoteBindRefused, match=name):
            check_endpoints({name: "tcp://10.1.2.3:1"}, True)


def test_no_engine_is_a_clear_timeout(tmp_path):
    c = EngineClient(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", timeout_s=0.3)
    with pytest.raises(TimeoutError, match="no engine answered"):
        c.connect()
    c.close()


def test_sigterm_drains_in_flight_requests_and_exits_zero(engine):
    c = client(engine)
    rid = c.submit(prompt_token_ids=[17] * 4, max_tokens=250, ignore_eos=True)
    stream = c.stream(rid)
    next(stream)
    engine.signal(signal.SIGTERM)
    final = [o for o in stream][-1]
    assert final.finish_reason == "abort"
    c.close()
    engine.proc.wait(20)
    assert engine.proc.returncode == 0
    log = engine.log_text()
    assert "SIGTERM: draining" in log and "engine stopped (SIGTERM)" in log
