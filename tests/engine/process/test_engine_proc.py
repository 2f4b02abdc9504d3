"""The engine as a live process: real `vconsole engine`, real ZeroMQ sockets (ipc:// in a tmp dir).

One engine serves the whole module (starting one costs seconds on 2 cores); tests run in file
order and each leaves the engine idle. The last test shuts it down with SIGTERM.
"""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import msgpack
import numpy as np
import pytest
import zmq

from support.live_engine import Telemetry, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security import control_key, engine_key
from vconsole.wire import protocol
from vconsole.wire.control_client import ControlClient, NotAuthorised

pytestmark = [pytest.mark.proc, pytest.mark.slow]

CONFIG = """\
max_num_seqs = 4
telemetry_hz = 20.0
heartbeat_interval_s = 0.25
config_interval_s = 1.0
alert_waiting_warning = 5
"""
ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "40", "--block-size", "8",
               "--max-num-batched-tokens", "64", "--policy", "priority"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def engine(workdir):
    cfg = workdir / "engine.toml"
    cfg.write_text(CONFIG)
    eps = {n: f"ipc://{workdir}/{n}" for n in ("input", "output", "telemetry", "control")}
    # The Python layers (not the native decode step of #47): the SIGTERM test needs a request
    # still in flight when the signal lands, and on a loaded machine the native steps could
    # finish it before the client has read its first token.
    proc = EngineProcess([*ENGINE_ARGS, "--config", str(cfg)], endpoints=eps,
                         log_path=workdir / "engine.log",
                         env={"VCONSOLE_DECODE_STEP": "python"})
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


def control(engine, key: str | None | bool = True) -> ControlClient:
    """A control client holding the engine's key (``key=True``), another key, or none."""
    if key is True:
        key = engine.control_key()
        assert key, f"no control key at {engine.control_key_file}"
    return ControlClient(engine.endpoints["control"], timeout_s=10, key=key or None)


def prompts(n: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 259) for _ in range(rng.randint(3, 20))], rng.randint(1, 6),
             rng.choice([0, 0, 1, 2])) for _ in range(n)]


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

    # First: two torch processes on 2 cores thrash.
    expected = reference_outputs([(ids, n) for ids, n, _ in work])
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


def test_control_key_file_is_private_and_derived_from_the_endpoint(engine):
    path = engine.control_key_file
    assert path == control_key.control_key_file(engine.endpoints["control"])  # what a bare client finds
    assert path.parent == control_key.runtime_dir()
    assert path.stat().st_mode & 0o777 == 0o600
    key = path.read_text().strip()
    assert len(key) == 2 * engine_key.KEY_BYTES and int(key, 16) >= 0
    assert control_key.load_control_key(engine.endpoints["control"]) == key
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_set_config_without_the_key_is_refused_and_changes_nothing(engine):
    with control(engine) as ctl:
        before = ctl.get_config()
    path = str(engine.control_key_file)
    for key in (None, "0" * 64, engine.control_key()[:-1]):
        with control(engine, key=key) as anon:
            assert anon.get_config()["values"] == before["values"]  # reading stays open
            with pytest.raises(NotAuthorised) as err:
                anon.set_config({"max_num_seqs": 1})
            assert str(err.value) == ("not authorised: this client does not hold the engine's "
                                      f"control key ({path})")
            raw = anon.request("set_config", {"max_num_seqs": 1})
            assert raw["ok"] is False and not raw["applied"] and raw["values"] == {}
    # A key of the wrong type is a malformed request, not a crash.
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(engine.endpoints["control"])
    req.send(msgpack.packb({"op": "set_config", "values": {"max_num_seqs": 1}, "key": 5}))
    assert req.poll(10_000)
    bad = msgpack.unpackb(req.recv())
    req.close(0)
    assert bad["ok"] is False and "'key' must be a string" in bad["error"]
    with control(engine) as ctl:
        after = ctl.get_config()
        assert after["version"] == before["version"] and after["values"] == before["values"]
        # With the key, the same change is applied.
        reply = ctl.set_config({"max_num_seqs": 3})
        assert reply["ok"] and reply["applied"] == {"max_num_seqs": 3}
        assert ctl.set_config({"max_num_seqs": before["values"]["max_num_seqs"]})["ok"]
    assert "refused a set_config without the control key" in engine.log_text()


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
    time.sleep(1.5)     # a fixed wait on purpose: the file watcher must NOT take this edit
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
        other = a.submit(prompt_token_ids=[9] * 5, max_tokens=20, ignore_eos=True)
        rid = a.submit(prompt_token_ids=[7] * 5, max_tokens=250, ignore_eos=True)
        # The abort follows the add on the same socket, so the engine reads it at most a step
        # later, however loaded the machine (a tiny engine decodes 250 tokens in ~0.3 s: an
        # abort sent after reading the first token raced it, and lost in CI).
        b.abort([other])  # not b's: ignored
        a.abort([rid])
        final = [o for o in a.stream(rid)][-1]
        assert final.finished and final.finish_reason == "abort"
        assert final.num_output_tokens < 250
        assert a.gather([other])[other].finish_reason == "length"


def test_request_ids_are_scoped_per_client(engine):
    """Another client using the same id neither blocks nor finishes ours."""
    with client(engine) as a, client(engine) as b:
        a.submit(prompt_token_ids=[11] * 4, max_tokens=50, ignore_eos=True, request_id="same")
        first = next(a.stream("same"))  # in flight (two sockets: no order between a and b)
        b.submit(prompt_token_ids=[12] * 4, max_tokens=2, ignore_eos=True, request_id="same")
        theirs = b.gather()["same"]
        assert theirs.finish_reason == "length" and len(theirs.output_token_ids) == 2
        rest = a.gather()["same"]
        assert rest.finish_reason == "length"
        assert len(first.new_token_ids) + len(rest.output_token_ids) == 50


def test_a_duplicate_id_from_one_client_leaves_its_request_running(engine):
    """The engine answers a duplicate with an ``in_flight`` error, never a second final output.
    The duplicate is sent right behind the original on the same socket, so the engine reads it
    while the original (300 tokens) is surely in flight: once the test waited for the first
    token and a CPU-starved CI machine finished all 300 before the duplicate was sent."""
    with client(engine) as a:
        rid = a.submit(prompt_token_ids=[11] * 4, max_tokens=300, ignore_eos=True)
        a._in.send_multipart(protocol.encode_add(rid, prompt_token_ids=[1, 2],
                                                 sampling={"max_tokens": 1}))  # past the guard
        bad = protocol.encode_add(rid, prompt_token_ids=np.arange(20, dtype=np.int32))
        a._in.send_multipart([*bad, b"x"] * 3)  # too many frames, naming the same request
        with pytest.raises(ValueError, match="in flight"):
            a.submit(prompt_token_ids=[1, 2], request_id=rid)  # the client's own guard
        rest = a.gather()[rid]
        assert rest.finish_reason == "length"
        assert len(rest.output_token_ids) == 300
        assert sum("duplicate" in e for e in a.protocol_errors) == 1
        assert sum("too many frames" in e for e in a.protocol_errors) == 1


def test_a_bad_message_naming_a_new_request_gets_its_final_output(engine):
    with client(engine) as a:
        bad = protocol.encode_add("fresh", prompt_token_ids=np.arange(30, dtype=np.int32))
        a._pending["fresh"] = deque()  # listen for it as submit() would
        a._in.send_multipart([*bad, *[b"pad"] * 8])
        (final,) = list(a.stream("fresh", timeout_s=30))
        assert final.finished and final.finish_reason == "error"
        assert "too many frames" in final.error


def test_a_huge_text_prompt_is_refused_before_tokenizing(engine):
    with client(engine) as a:
        done = a.generate("x" * 10_000_000, max_tokens=1, timeout_s=60)
        assert done.finish_reason == "error" and "max_prompt_chars" in done.error


def test_a_long_text_prompt_does_not_hold_back_other_clients_outputs(engine):
    """Tokenizing 800k characters takes seconds on this machine: it happens off the busy
    loop, so another client's stream keeps flowing while it runs."""
    window: dict[str, float] = {}
    big: list = []

    def send_big() -> None:
        with client(engine) as a:
            window["sent"] = time.monotonic()
            big.append(a.generate("y" * 800_000, max_tokens=1, timeout_s=120))
            window["done"] = time.monotonic()

    arrivals = []
    with client(engine) as b:
        t = threading.Thread(target=send_big)
        t.start()
        while "done" not in window and t.is_alive():
            rid = b.submit(prompt_token_ids=[21] * 4, max_tokens=40, ignore_eos=True)
            for _ in b.stream(rid, timeout_s=60):
                arrivals.append(time.monotonic())
        t.join(120)
        (done,) = big
        assert done.finish_reason == "error" and "max_model_len" in done.error  # tokenized
        during = [x for x in arrivals if window["sent"] < x < window["done"]]
        assert len(during) >= 10, f"only {len(during)} outputs while the prompt was prepared"


def test_a_vanished_client_has_its_requests_aborted(tmp_path):
    # A request long enough (2,000 tokens) that it cannot finish on its own before a client
    # starved of CPU gets to close: the engine has to notice the client left.
    with EngineProcess(["--model", "tiny", "--num-kv-blocks", "300", "--block-size", "8"],
                       endpoints=_ipc_endpoints(tmp_path),
                       log_path=tmp_path / "engine.log") as engine:
        tel = Telemetry(engine.endpoints["telemetry"])
        try:
            c = client(engine)
            rid = c.submit(prompt_token_ids=[13] * 4, max_tokens=2000, ignore_eos=True)
            next(c.stream(rid))
            c.close()
            t = time.monotonic()
            tel.wait_for("sched", lambda s: s["num_running"] == 0 and s["num_waiting"] == 0,
                         since=t, timeout_s=15)
            assert "is gone: aborting its 1 request(s)" in engine.log_text()
            assert tel.topic("sched", t)[-1]["num_generation_tokens_total"] < 2000
        finally:
            tel.close()


def test_non_loopback_endpoints_are_refused_without_opt_in():
    r = subprocess.run([sys.executable, "-m", "vconsole.cli", "engine", "--input",
                        "tcp://0.0.0.0:5999"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "non-loopback" in r.stderr and "CURVE" in r.stderr


def test_steering_sockets_stay_on_loopback_even_with_the_opt_in():
    from vconsole.security.bind_policy import RemoteBindRefused, check_endpoints

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


STATS_LINE = re.compile(
    r"vconsole\.engine: stats: ([\d.]+) steps/s, prompt ([\d.]+) tok/s, generation ([\d.]+) "
    r"tok/s, running (\d+), waiting (\d+), preempted (\d+), KV usage ([\d.]+)% \(tokens "
    r"([\d.]+)%\), prefix hit rate ([\d.]+)%")


def _ipc_endpoints(d) -> dict[str, str]:
    return {n: f"ipc://{d}/{n}" for n in ("input", "output", "telemetry", "control")}


def test_log_stats_is_off_by_default(engine):
    with control(engine) as ctl:
        assert ctl.get_config()["values"]["log_stats"] is False
        ctl.set_config({"log_stats_interval_s": 0.5})
    try:
        with client(engine) as c:
            c.generate(prompt_token_ids=[21] * 8, max_tokens=8, ignore_eos=True, timeout_s=30)
        time.sleep(2.0)  # four intervals: a line would be due by now
        assert "vconsole.engine: stats: " not in engine.log_text()
    finally:
        with control(engine) as ctl:
            ctl.set_config({"log_stats_interval_s": 5.0})


def test_log_stats_logs_a_stats_line_every_interval_and_the_toggle_is_hot(tmp_path):
    interval = 1.0
    with EngineProcess([*ENGINE_ARGS, "--set", "log_stats=true",
                        "--set", f"log_stats_interval_s={interval}"],
                       endpoints=_ipc_endpoints(tmp_path),
                       log_path=tmp_path / "engine.log") as proc, client(proc) as c:
        for i in range(4):
            c.submit(prompt_token_ids=[3 + i] * 12, max_tokens=8, ignore_eos=True)
        assert all(d.finish_reason == "length" for d in c.gather(timeout_s=30).values())
        deadline = time.monotonic() + interval + 10

        def quiet_line() -> bool:     # lines while steps ran, then one with none: drained
            lines = STATS_LINE.findall(proc.log_text())
            return bool(lines) and float(lines[-1][0]) == 0

        while not quiet_line():
            assert time.monotonic() < deadline, f"no stats line:\n{proc.log_tail()}"
            time.sleep(0.1)
        lines = STATS_LINE.findall(proc.log_text())
        busy, quiet = lines[:-1], lines[-1]
        assert busy and all(float(v[0]) > 0 for v in busy), "each line before reports steps"
        steps, prompt_tps, gen_tps = (float(v) for v in busy[0][:3])
        assert steps > 0 and prompt_tps > 0 and gen_tps > 0
        assert quiet[3:6] == ("0", "0", "0")  # drained: running, waiting, preempted
        assert 0 <= float(quiet[6]) <= 100 and 0 <= float(quiet[8]) <= 100
        time.sleep(interval * 2.5)
        assert len(STATS_LINE.findall(proc.log_text())) == len(lines), "then nothing"

        with control(proc) as ctl:
            assert ctl.set_config({"log_stats": "false"})["applied"] == {"log_stats": False}
        for i in range(4):
            c.submit(prompt_token_ids=[30 + i] * 12, max_tokens=8, ignore_eos=True)
        c.gather(timeout_s=30)
        time.sleep(interval * 2.5)
        assert len(STATS_LINE.findall(proc.log_text())) == len(lines), "log_stats=false logs"


STARVED_S = 0.1   # a heartbeat received this late: the test process was not running


def test_a_client_that_stops_reading_holds_back_no_other_clients_output(tmp_path):
    """Measured in engine steps, not seconds: while a client that never reads fills its send
    queue and is dropped, another client's stream gets its token of every step as the step
    runs. The engine's own step counter (telemetry ``health.steps``, a separate socket) is the
    clock: steps run minus tokens received stays flat; an output held behind the stuck client
    (a blocking send) would let the steps run ahead by hundreds."""
    args = ["--model", "tiny", "--num-kv-blocks", "2400", "--block-size", "8",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--set", "zmq_sndhwm=100",
            "--set", "heartbeat_interval_s=0.05"]
    with EngineProcess(args, endpoints=_ipc_endpoints(tmp_path),
                       log_path=tmp_path / "engine.log") as proc:
        tel = Telemetry(proc.endpoints["telemetry"])
        ctx = zmq.Context.instance()
        inp, out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (inp, out):
            s.setsockopt(zmq.IDENTITY, b"stuck-client")
            s.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.RCVHWM, 1)
        out.setsockopt(zmq.RCVBUF, 1024)
        out.connect(proc.endpoints["output"])
        inp.connect(proc.endpoints["input"])
        # (wall time, tokens received so far): compared with each heartbeat's own publish time,
        # so a heartbeat that reaches this process late does not count as a lag.
        arrivals: list[tuple[float, int]] = []
        gone_at_tokens = None
        try:
            inp.send_multipart(protocol.encode_hello(), copy=False)
            assert out.poll(10_000)
            out.recv_multipart()  # ready; from here on this client never reads again
            with client(proc) as c:
                rid = c.submit(prompt_token_ids=[50, 51], max_tokens=1500, ignore_eos=True)
                stream = c.stream(rid, timeout_s=60)
                arrivals.append((time.time(), next(stream).num_output_tokens))
                started = time.monotonic()
                for i in range(16):
                    inp.send_multipart(protocol.encode_add(
                        f"stuck-{i}", prompt_token_ids=[5 + i] * 4,
                        sampling={"max_tokens": 1000, "ignore_eos": True}), copy=False)
                for o in stream:
                    arrivals.append((time.time(), o.num_output_tokens))
                    if gone_at_tokens is None and o.num_output_tokens % 10 == 0 \
                            and "not reading its outputs" in proc.log_text():
                        gone_at_tokens = o.num_output_tokens
                    # Enough clock for the lags below: 100 tokens past the drop and 40
                    # heartbeats (with fast steps, 100 tokens take well under a second).
                    if gone_at_tokens is not None and o.num_output_tokens > gone_at_tokens + 100 \
                            and len(tel.topic("health", since=started)) > 40:
                        c.abort([rid])
                        list(stream)
                        break
        finally:
            inp.close(0)
            out.close(0)
            tel.close()
        assert gone_at_tokens is not None, \
            f"the stuck client's queue never filled:\n{proc.log_tail()}"
        first, last = arrivals[0][0], arrivals[-1][0]
        lags = []
        # Telemetry stamps receipt on the monotonic clock; heartbeats carry wall time.
        wall_minus_mono = time.time() - time.monotonic()
        for got_at, _topic, p in tel.messages:
            if _topic == "health" and first < p["ts"] < last:
                if got_at + wall_minus_mono - p["ts"] > STARVED_S:
                    # This process itself was not running (a loaded machine): its tokens came
                    # late for the same reason, which says nothing about the engine.
                    continue
                received = max(n for when, n in arrivals if when <= p["ts"])
                lags.append(p["steps"] - received)
        assert len(lags) > 20
        # An output held behind the stuck client (a blocking send) lets the steps run ahead
        # for good: the lag grows and never comes back. This process not scheduled for a
        # while (a loaded machine) makes a burst of lag that it catches up on: in the last
        # quarter of the run, and at the median, the lag is back near its least.
        tail = lags[len(lags) * 3 // 4:]
        assert min(tail) - min(lags) <= 5, f"outputs fell behind the engine's steps: {lags}"
        assert sorted(lags)[len(lags) // 2] - min(lags) <= 5, lags
        log = proc.log_text()
        assert "client stuck-client: not reading its outputs (send queue full)" in log
        assert "client stuck-client is gone: aborting its 16 request(s)" in log


class _IdleCore:
    """Just enough of EngineCore for the process shell: no requests, ever."""

    def __init__(self) -> None:
        from vconsole.engine.telemetry_guard import TelemetryGuard
        from vconsole.shared.config import EngineConfig

        self.config = EngineConfig()
        self.config_version = 1
        self.num_steps = 0
        self.last_step = None
        self.consecutive_step_failures = 0
        self.last_step_error = None
        self.telemetry_guard = TelemetryGuard()

    def model_info(self) -> dict:
        return {"device": "cpu", "vocab_size": None, "max_model_len": None,
                "num_kv_blocks": None}

    def has_unfinished_requests(self) -> bool:
        return False

    def has_ready_requests(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def set_wakeup(self, wake) -> None:
        pass

    def abort_requests(self, ids) -> None:
        pass

    def scheduler_stats(self, max_rows, rows=None):
        return None

    def kv_stats(self):
        return None

    def latency_batch(self):
        return None

    def enable_kv_events(self) -> None:
        pass

    def take_kv_events(self):
        return []

    def detokenize(self, token_ids) -> str:
        return ""


def test_shutdown_does_not_hang_when_the_telemetry_thread_does_not_stop(tmp_path, monkeypatch):
    from vconsole.engine.process import core_proc, telemetry_outlets
    from vconsole.engine.publish import publisher_process
    from vconsole.engine.publish.publish_loop import PublishLoop

    release = threading.Event()
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path / "run"))
    # The publisher runs as a thread here: its process cannot start (the engine falls back).
    monkeypatch.setattr(publisher_process, "CHILD_MODULE", "vconsole.no_such_module")
    monkeypatch.setattr(PublishLoop, "run", lambda self, *a: release.wait())
    monkeypatch.setattr(telemetry_outlets, "PUBLISHER_CLOSE_S", 0.3)
    core = _IdleCore()
    proc = core_proc.EngineCoreProc(core.config, _ipc_endpoints(tmp_path), core=core)
    proc.start()
    proc.request_shutdown("test")
    t = threading.Thread(target=proc.run_busy_loop, daemon=True)
    t.start()
    try:
        t.join(10)
        assert not t.is_alive(), "shutdown hung (ctx.term() with the telemetry socket open)"
    finally:
        release.set()
    assert proc.ctx.closed


def test_shutdown_does_not_hang_when_the_publisher_process_does_not_stop(tmp_path, monkeypatch):
    from vconsole.engine.process import core_proc, telemetry_outlets

    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(telemetry_outlets, "PUBLISHER_CLOSE_S", 0.3)
    core = _IdleCore()
    proc = core_proc.EngineCoreProc(core.config, _ipc_endpoints(tmp_path), core=core)
    child = proc.publisher.child
    assert child is not None and child.is_alive()      # the engine's publisher is a process
    os.kill(child.pid, signal.SIGSTOP)                 # it will not answer the stop
    proc.start()
    proc.request_shutdown("test")
    t = threading.Thread(target=proc.run_busy_loop, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "shutdown hung on a publisher process that does not stop"
    assert not child.is_alive(), "the stopped publisher process was left behind"
    assert proc.ctx.closed


def test_sigterm_aborts_in_flight_requests_says_so_and_exits_zero(engine):
    key_file = engine.control_key_file
    assert key_file.exists()
    c = client(engine)
    # As long as the pool (40 blocks of 8) allows: in flight when the signal lands.
    rid = c.submit(prompt_token_ids=[17] * 4, max_tokens=300, ignore_eos=True)
    stream = c.stream(rid)
    next(stream)
    engine.signal(signal.SIGTERM)
    final = [o for o in stream][-1]
    assert final.finish_reason == "abort"
    c.close()
    engine.child.wait(20)
    assert engine.child.returncode == 0
    log = engine.log_text()
    assert "SIGTERM: stopping" in log and "engine stopped (SIGTERM)" in log
    # A stop is not a drain, and the log says what became of the request in flight.
    assert "stopping with 1 request(s) in flight: each ends with finish_reason 'abort'" in log
    assert not key_file.exists(), "the control key file outlived a clean shutdown"
    assert not engine.ready_path.exists(), "the ready file outlived a clean shutdown"
