"""Control key files outlive a killed engine: the owner record tells a stale file (its engine is
gone: replace it, and tell a client so) from a live one (never overwrite it: refuse to start).

The file-level rules run against real processes (one that has exited, one that is running);
the engine-level ones kill a real engine with SIGKILL and start others on its endpoints.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from vconsole.cli import build_parser
from vconsole.commands.control import main_get
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security import engine_key, key_owner
from vconsole.security.control_key import read_key_file
from vconsole.security.key_owner import GONE, RUNNING, KeyOwner
from vconsole.wire.control_client import ControlClient

ENGINE_ARGS = ["--no-supervisor", "--model", "tiny", "--num-kv-blocks", "16",
               "--max-num-seqs", "4"]


@pytest.fixture
def sleeper():
    """A running process that is not an engine (and not this one)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(path, pid: int, started: float | None = None, engine_id: str = "old-0") -> str:
    """A key file with an owner record naming ``pid``, as an engine would leave it."""
    key = engine_key.new_key()
    owner = KeyOwner.for_this_process(key, engine_id=engine_id, endpoint="ipc:///x/control")
    record = {**json.loads(owner.to_json()), "pid": pid,
              "started": started if started is not None
              else (key_owner.process_started(pid) or time.time() - 60)}
    key_owner.owner_path(path).write_text(json.dumps(record))
    engine_key.write_key_file(path, key)
    return key


def test_a_key_file_whose_engine_exited_is_replaced_and_the_replacement_is_logged(tmp_path,
                                                                                   caplog):
    path = tmp_path / "control.key"
    dead = exited_pid()
    old = plant(path, dead)
    assert key_owner.status(path, old).state == GONE
    with caplog.at_level(logging.WARNING, "vconsole.engine"):
        engine_key.claim_key_file(path, "ab" * 32, engine_id="new-0", endpoint="ipc://c")
    assert read_key_file(path) == "ab" * 32
    found = key_owner.status(path, "ab" * 32)
    assert found.state == RUNNING and found.owner.engine_id == "new-0"
    assert f"engine old-0 (pid {dead}), which is no longer running" in caplog.text


def test_a_reused_pid_does_not_make_a_stale_file_look_alive(tmp_path, sleeper):
    path = tmp_path / "control.key"
    old = plant(path, sleeper.pid, started=time.time() - 3600)   # same pid, another process
    assert key_owner.status(path, old).state == GONE
    engine_key.claim_key_file(path, "cd" * 32, engine_id="new-0", endpoint="ipc://c")
    assert read_key_file(path) == "cd" * 32


def test_a_killed_engine_not_yet_reaped_counts_as_gone(tmp_path, sleeper):
    path = tmp_path / "control.key"
    old = plant(path, sleeper.pid)
    sleeper.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while key_owner.status(path, old).state != GONE:          # a zombie until waited for
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sleeper.poll() is not None


def test_a_key_file_whose_engine_runs_is_never_overwritten(tmp_path, sleeper):
    path = tmp_path / "control.key"
    old = plant(path, sleeper.pid)
    before = path.read_bytes(), key_owner.owner_path(path).read_bytes()
    with pytest.raises(engine_key.KeyFileHeld, match=f"pid {sleeper.pid}.*still running"):
        engine_key.claim_key_file(path, "ef" * 32, engine_id="new-0", endpoint="ipc://c")
    assert (path.read_bytes(), key_owner.owner_path(path).read_bytes()) == before
    assert key_owner.status(path, old).state == RUNNING


def test_a_key_file_without_an_owner_record_is_replaced(tmp_path):
    path = tmp_path / "control.key"
    engine_key.write_key_file(path, "12" * 32)
    engine_key.claim_key_file(path, "34" * 32, engine_id="new-0", endpoint="ipc://c")
    assert read_key_file(path) == "34" * 32


def test_the_owner_record_goes_with_its_key_and_only_with_it(tmp_path):
    path = tmp_path / "control.key"
    engine_key.claim_key_file(path, "56" * 32, engine_id="e", endpoint="ipc://c")
    assert not engine_key.remove_key_file(path, "78" * 32)     # another engine's key
    assert path.exists() and key_owner.owner_path(path).exists()
    assert engine_key.remove_key_file(path, "56" * 32)
    assert not path.exists() and not key_owner.owner_path(path).exists()


# --- real engines -------------------------------------------------------------------------------

def vconsole(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *argv], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.long   # make test-long: the stale-key rules are the unit tests above, on real processes
@pytest.mark.proc
@pytest.mark.slow
def test_a_killed_engine_leaves_a_stale_key_that_clients_name_and_the_next_engine_replaces(
        tmp_path, capsys):
    eps = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    first = EngineProcess(ENGINE_ARGS, endpoints=eps, log_path=tmp_path / "first.log").start()
    try:
        control_key_file, first_pid = first.control_key_file, first.pid
        stale = first.control_key()
        first.signal(signal.SIGKILL)
        first.child.wait(20)
    finally:
        first.stop()
    assert read_key_file(control_key_file) == stale                  # SIGKILL: nothing cleaned up
    assert key_owner.status(control_key_file, stale).state == GONE

    r = vconsole("set", "--control", eps["control"], "max_num_seqs=2")
    assert r.returncode == 1
    assert f"(pid {first_pid}), no longer running" in r.stderr and "Start the engine" in r.stderr
    args = build_parser().parse_args(["get", "--control", eps["control"]])
    args.timeout = 0.5
    assert main_get(args) == 1
    assert f"was left by engine engine-0 (pid {first_pid}), no longer running" in \
        capsys.readouterr().err

    with EngineProcess(ENGINE_ARGS, endpoints=eps, log_path=tmp_path / "second.log") as second:
        assert second.control_key_file == control_key_file
        key = second.control_key()
        assert key != stale
        owner = key_owner.read_owner(control_key_file)
        assert owner is not None and owner.pid == second.pid
        assert key_owner.status(control_key_file, key).state == RUNNING
        assert (f"replacing the control key file {control_key_file}: left by engine engine-0 "
                f"(pid {first_pid}), which is no longer running") in second.log_text()
        r = vconsole("set", "--control", eps["control"], "max_num_seqs=2")
        assert r.returncode == 0, r.stderr

        # A third engine on the same control endpoint: refused before it binds anything (an
        # ipc:// bind would take the path), and the running engine's key stays valid.
        other = {n: f"ipc://{tmp_path}/third-{n}" for n in ("input", "output", "telemetry")}
        r = vconsole("engine", *ENGINE_ARGS, "--control", eps["control"],
                     *[a for n, ep in other.items() for a in (f"--{n}", ep)])
        assert r.returncode == 2
        assert f"pid {second.pid}), which is still running" in r.stderr
        assert read_key_file(control_key_file) == key
        assert key_owner.read_owner(control_key_file) == owner
        with ControlClient(eps["control"], key=key, timeout_s=10) as ctl:
            assert ctl.set_config({"max_num_seqs": 3})["ok"]
        with EngineClient(eps["input"], eps["output"], timeout_s=10) as c:
            assert c.generate(prompt_token_ids=[4, 5], max_tokens=2, ignore_eos=True,
                              timeout_s=30).finished
    assert not control_key_file.exists() and not key_owner.owner_path(control_key_file).exists()
