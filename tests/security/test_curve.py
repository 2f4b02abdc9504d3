"""CURVE: keys made by `vconsole keys`, an engine that takes them, and who gets through.

One engine serves the module: started with the keys `vconsole keys` wrote, on loopback (CURVE
works on loopback too; nothing here binds beyond it). Clients with the authorised key pair and
the engine's public key are served; clients without keys, with a pair the engine does not know,
or expecting another server get no reply at all, and the engine keeps serving the good ones.
The non-loopback rule is tested on the policy function and on a refused start, never by
exposing a port.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest
import zmq

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security.bind_policy import RemoteBindRefused, check_endpoints
from vconsole.security.curve import ClientCurve, CurveKeyError, load_client_curve
from vconsole.security.curve_server import load_server_curve
from vconsole.security.key_owner import RUNNING, read_owner
from vconsole.tools.top import snapshot_once
from vconsole.wire.control_client import ControlClient, NotAuthorised

ENGINE_ID = "curve-0"
ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "24", "--max-num-seqs", "4",
               "--set", f"engine_id={ENGINE_ID}", "--set", "heartbeat_interval_s=0.25",
               "--set", "telemetry_hz=20"]
NO_REPLY_S = 1.0


def vconsole(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *argv], capture_output=True,
                          text=True, timeout=timeout)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve") / "keys"
    r = vconsole("keys", str(d), timeout=60)
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def engine(keys, tmp_path_factory):
    log = tmp_path_factory.mktemp("curve-engine") / "engine.log"
    proc = EngineProcess([*ENGINE_ARGS, "--curve-server-key", str(keys / "server.key_secret"),
                          "--curve-clients", str(keys / "authorized_clients")], log_path=log)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def good(keys) -> ClientCurve:
    curve = load_client_curve(keys / "server.key", keys / "client.key_secret")
    assert curve is not None
    return curve


def client_args(keys) -> list[str]:
    return ["--curve-server-public", str(keys / "server.key"),
            "--curve-client-key", str(keys / "client.key_secret")]


# --- vconsole keys ------------------------------------------------------------------------------

def test_keys_writes_two_pairs_with_private_secrets_and_authorises_the_client(keys):
    for name in ("server", "client"):
        assert mode(keys / f"{name}.key_secret") == 0o600
        assert (keys / f"{name}.key").is_file()
    assert mode(keys) == 0o700
    assert [p.name for p in (keys / "authorized_clients").iterdir()] == ["client.key"]
    assert (keys / "authorized_clients" / "client.key").read_bytes() == \
        (keys / "client.key").read_bytes()
    assert not [p for p in keys.iterdir() if p.name.startswith(".")]   # no staging left


def test_keys_never_overwrites_and_adds_a_second_client_under_the_same_server(keys):
    before = (keys / "server.key_secret").read_bytes(), (keys / "client.key_secret").read_bytes()
    r = vconsole("keys", str(keys))
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
    r = vconsole("keys", str(keys), "--client", "laptop")
    assert r.returncode == 0, r.stderr
    assert "server key pair (kept)" in r.stdout
    assert ((keys / "server.key_secret").read_bytes(),
            (keys / "client.key_secret").read_bytes()) == before
    assert mode(keys / "laptop.key_secret") == 0o600
    assert (keys / "authorized_clients" / "laptop.key").is_file()
    curve = load_server_curve(keys / "server.key_secret", keys / "authorized_clients")
    assert curve is not None and len(curve.clients) == 2


# --- the engine with keys ---------------------------------------------------------------------

@pytest.mark.proc
@pytest.mark.slow
def test_an_authorised_client_submits_a_request_and_gets_its_output(engine, good):
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"], curve=good,
                      timeout_s=10) as c:
        done = c.generate(prompt_token_ids=[7, 8, 9], max_tokens=5, ignore_eos=True, timeout_s=30)
    assert done.finished and done.finish_reason == "length" and len(done.output_token_ids) == 5
    assert c.engine_info["engine_id"] == ENGINE_ID


@pytest.mark.proc
@pytest.mark.slow
async def test_the_async_client_with_keys_is_served_too(engine, good):
    async with AsyncEngineClient(engine.endpoints["input"], engine.endpoints["output"],
                                 curve=good, timeout_s=10) as c:
        done = await c.generate(prompt_token_ids=[3, 4], max_tokens=3, ignore_eos=True)
    assert done.finished and len(done.output_token_ids) == 3


@pytest.mark.proc
@pytest.mark.slow
def test_control_with_keys_reads_config_and_still_needs_the_control_key_to_change_it(
        engine, good):
    with ControlClient(engine.endpoints["control"], curve=good, timeout_s=10) as ctl:
        before = ctl.get_config()
        assert before["values"]["engine_id"] == ENGINE_ID
        with pytest.raises(NotAuthorised):       # CURVE lets it in; the key lets it steer
            ctl.set_config({"max_num_seqs": 3})
    with ControlClient(engine.endpoints["control"], curve=good, timeout_s=10,
                       key=engine.control_key()) as ctl:
        assert ctl.set_config({"max_num_seqs": 3})["applied"] == {"max_num_seqs": 3}
        assert ctl.set_config({"max_num_seqs": before["values"]["max_num_seqs"]})["ok"]


def strangers(good: ClientCurve) -> dict[str, ClientCurve | None]:
    """Every kind of client the engine must not answer."""
    unknown_pub, unknown_sec = zmq.curve_keypair()
    other_server, _ = zmq.curve_keypair()
    return {"no keys": None,
            "an unauthorised key pair": ClientCurve(good.server_public, unknown_pub, unknown_sec),
            "another server's public key": ClientCurve(other_server, good.public, good.secret)}


@pytest.mark.proc
@pytest.mark.slow
def test_clients_without_an_authorised_key_pair_get_no_reply_and_the_engine_keeps_serving(
        engine, good):
    eps = engine.endpoints
    with EngineClient(eps["input"], eps["output"], curve=good, timeout_s=10) as served:
        for why, curve in strangers(good).items():
            c = EngineClient(eps["input"], eps["output"], curve=curve, timeout_s=NO_REPLY_S)
            with pytest.raises(TimeoutError, match="no engine answered"):
                c.connect()
            c.close()
            with ControlClient(eps["control"], curve=curve, timeout_s=NO_REPLY_S,
                               key=engine.control_key()) as ctl, \
                    pytest.raises(TimeoutError, match="no reply"):
                ctl.set_config({"max_num_seqs": 1})
            done = served.generate(prompt_token_ids=[5] * 4, max_tokens=2, ignore_eos=True,
                                   timeout_s=30)
            assert done.finish_reason == "length", why
    assert engine.child.poll() is None
    log = engine.log_text()
    assert "CURVE: refused a client whose public key is not authorised" in log
    with ControlClient(eps["control"], curve=good, timeout_s=10) as ctl:
        assert ctl.get_config()["values"]["max_num_seqs"] != 1   # no stranger changed it


@pytest.mark.proc
@pytest.mark.slow
def test_telemetry_is_curve_too_only_key_holders_receive_it(engine, good):
    snap, missing = snapshot_once(engine.endpoints["telemetry"], None, 10, curve=good)
    assert not [t for t in missing if t != "config"] and snap["health"]["engine"] == ENGINE_ID
    snap, missing = snapshot_once(engine.endpoints["telemetry"], None, NO_REPLY_S)
    assert snap == {} and "health" in missing


@pytest.mark.proc
@pytest.mark.slow
def test_cli_clients_take_the_key_paths(engine, keys):
    eps = engine.endpoints
    r = vconsole("set", "--control", eps["control"], *client_args(keys),
                 "--control-key-file", str(engine.control_key_file), "policy=priority")
    assert r.returncode == 0, r.stderr
    r = vconsole("get", "--control", eps["control"], *client_args(keys), "policy", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["values"] == {"policy": "priority"}
    r = vconsole("load", "--input", eps["input"], "--output", eps["output"], *client_args(keys),
                 "--num", "4", "--prompt-len", "4:8", "--output-len", "2:4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["completed"] == 4
    r = vconsole("top", "--telemetry", eps["telemetry"], "--control", eps["control"],
                 *client_args(keys), "--once", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["health"]["engine"] == ENGINE_ID


def test_a_client_given_half_the_keys_is_a_usage_error(keys):
    r = vconsole("get", "--control", "ipc:///nonexistent/control",
                 "--curve-server-public", str(keys / "server.key"))
    assert r.returncode == 2 and "--curve-client-key" in r.stderr


@pytest.mark.proc
@pytest.mark.slow
async def test_the_console_with_keys_shows_the_engine_and_whose_key_it_holds(engine, good):
    from textual.widgets import Static

    from vconsole.console.app import VConsoleApp

    app = VConsoleApp(telemetry_endpoints=[engine.endpoints["telemetry"]],
                      control_endpoint=engine.endpoints["control"], curve=good,
                      control_key_file=engine.control_key_file)
    assert not app.readonly
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        deadline = time.monotonic() + 20
        while not (app.state.config is not None and app.steering.key_status is not None
                   and app.state.engines):
            assert time.monotonic() < deadline, app.steering.control_error
            await pilot.pause(0.05)
        app.refresh_view(force=True)
        await pilot.pause()
        summary = str(app.screen.query_one("#cfg-summary", Static).render())
    owner = read_owner(engine.control_key_file)       # the engine process that wrote the key
    assert owner is not None and owner.liveness() == RUNNING
    assert f"key {ENGINE_ID} pid {owner.pid}" in summary
    assert "gone" not in summary and "read-only" not in summary


# --- keys: files and the rule ------------------------------------------------------------------

def test_key_files_that_are_wrong_are_refused_with_the_reason(tmp_path, keys):
    with pytest.raises(CurveKeyError, match="only a public key"):
        load_client_curve(keys / "server.key", keys / "client.key")
    leaky = tmp_path / "leaky.key_secret"
    leaky.write_bytes((keys / "client.key_secret").read_bytes())
    leaky.chmod(0o644)
    with pytest.raises(CurveKeyError, match="chmod 600"):
        load_client_curve(keys / "server.key", leaky)
    empty = tmp_path / "nobody"
    empty.mkdir()
    with pytest.raises(CurveKeyError, match="no client could connect"):
        load_server_curve(keys / "server.key_secret", empty)
    with pytest.raises(CurveKeyError, match="--curve-clients"):
        load_server_curve(keys / "server.key_secret", None)
    assert load_client_curve(None, None) is None and load_server_curve(None, None) is None


@pytest.mark.parametrize("name", ["input", "output", "control"])
def test_a_steering_socket_binds_beyond_loopback_only_with_keys(name):
    eps = {name: "tcp://0.0.0.0:*"}
    for allow_remote in (False, True):
        with pytest.raises(RemoteBindRefused) as err:
            check_endpoints(eps, allow_remote)
        why = str(err.value)
        assert f"{name}=tcp://0.0.0.0:*" in why and "CURVE" in why
        assert "vconsole keys" in why and "--curve-server-key" in why and "SSH tunnel" in why
    check_endpoints(eps, False, curve=True)


def test_telemetry_binds_beyond_loopback_with_the_opt_in_or_with_keys():
    eps = {"telemetry": "tcp://0.0.0.0:*"}
    with pytest.raises(RemoteBindRefused, match="--allow-remote-telemetry"):
        check_endpoints(eps, False)
    check_endpoints(eps, True)
    check_endpoints(eps, False, curve=True)


@pytest.mark.proc
def test_the_engine_refuses_a_remote_bind_without_keys_before_binding_anything(tmp_path):
    ready = tmp_path / "ready.json"
    r = vconsole("engine", "--input", "tcp://0.0.0.0:*", "--ready-file", str(ready), timeout=60)
    assert r.returncode == 2
    assert "non-loopback" in r.stderr and "--curve-server-key" in r.stderr
    assert "SSH tunnel" in r.stderr and "Traceback" not in r.stderr
    assert "control key:" not in r.stderr and "engine core ready" not in r.stderr
    assert not ready.exists()
