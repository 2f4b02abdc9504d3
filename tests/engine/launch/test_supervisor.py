"""`vconsole engine` under its supervisor: a dead engine process comes back on the same
endpoints and says so on telemetry; one that keeps dying, or can never start, is given up with a
clear message; SIGTERM drains and leaves nothing behind.

Real processes throughout (`vconsole.engine.launch.engine_process.EngineProcess`, the launcher
the demo uses), real sockets, ``kill -9``; the restart policy itself is pure and tested with a
made-up clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import zmq

from vconsole.commands.demo import closing_line
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.launch.restart_policy import RestartPolicy
from vconsole.telemetry import schema
from vconsole.wire import exit_codes
from vconsole.wire.exit_codes import describe_exit
from vconsole.wire.ready_file import read_ready_file

ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "128", "--block-size", "16",
               "--set", "heartbeat_interval_s=0.1"]


# --- the policy -----------------------------------------------------------------------------

def test_backoff_doubles_per_failure_in_the_window_up_to_the_cap():
    policy = RestartPolicy(max_restarts=10, window_s=100.0, backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.on_failure(t) for t in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_more_than_max_restarts_failures_within_the_window_give_up():
    policy = RestartPolicy(max_restarts=2, window_s=10.0)
    assert policy.on_failure(0.0) is not None
    assert policy.on_failure(1.0) is not None
    assert policy.on_failure(2.0) is None


def test_failures_older_than_the_window_are_forgiven_and_the_backoff_starts_over():
    policy = RestartPolicy(max_restarts=2, window_s=10.0, backoff_s=0.5)
    policy.on_failure(0.0)
    policy.on_failure(1.0)
    assert policy.on_failure(11.5) == 0.5       # the two early ones left the window
    assert policy.failures_in_window == 1


def test_zero_max_restarts_never_restarts_and_bad_settings_are_refused():
    assert RestartPolicy(max_restarts=0).on_failure(0.0) is None
    for bad in ({"max_restarts": -1}, {"window_s": 0}, {"backoff_s": 0}):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


def test_exits_read_as_a_person_says_them():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(exit_codes.STEP_FAILURES).startswith("exit code 3")


# --- the process --------------------------------------------------------------------------

class Health:
    """Every ``health`` message on one endpoint, in arrival order, from a SUB thread that
    reconnects quickly (the endpoint changes hands: engine, supervisor, engine)."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()

    TOPIC = b"health"

    def _run(self, endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.TOPIC)
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 50)
        sock.connect(endpoint)
        while not self._stop.is_set():
            if sock.poll(50):
                self.messages.append(schema.decode(sock.recv_multipart()).payload)
        sock.close(0)

    def wait_for(self, pred, what: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in list(self.messages):
                if pred(msg):
                    return msg
            time.sleep(0.05)
        raise AssertionError(f"no health message {what} within {timeout_s} s")

    def index(self, msg: dict) -> int:
        return next(i for i, m in enumerate(self.messages) if m is msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def child_of(engine: EngineProcess) -> int:
    """The engine child's pid, from the supervisor's ready file."""
    record = read_ready_file(engine.ready_path)
    assert record is not None and record["pid"] == engine.pid and record["supervised"]
    return record["child_pid"]


def wait_for_new_child(engine: EngineProcess, old: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = read_ready_file(engine.ready_path)
        if record is not None and record["child_pid"] != old:
            return record
        assert engine.child.poll() is None, f"the supervisor exited:\n{engine.log_tail()}"
        time.sleep(0.05)
    raise AssertionError(f"no restarted engine within {timeout_s} s:\n{engine.log_tail()}")


def assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.05)


def first_token(client: EngineClient, rid: str) -> None:
    """Block until ``rid`` produced output: it is in flight in the engine."""
    for out in client.stream(rid, timeout_s=60):
        assert not out.finished, out
        if out.new_token_ids:
            return


@pytest.mark.proc
@pytest.mark.slow
def test_a_killed_engine_is_restarted_on_the_same_endpoints_and_telemetry_says_so(tmp_path):
    engine = EngineProcess([*ENGINE_ARGS, "--restart-backoff", "2"],
                           log_path=tmp_path / "engine.log")
    with engine:
        first = child_of(engine)
        endpoints = dict(engine.endpoints)
        health = Health(endpoints["telemetry"])
        try:
            health.wait_for(lambda m: m["pid"] == first, "from the first engine")
            with EngineClient(endpoints["input"], endpoints["output"]) as old_client:
                in_flight = [old_client.submit(prompt_token_ids=[5, 6, 7], max_tokens=900,
                                               ignore_eos=True) for _ in range(2)]
                first_token(old_client, in_flight[0])
                os.kill(first, signal.SIGKILL)
                record = wait_for_new_child(engine, first)
            second = record["child_pid"]
            assert record["endpoints"] == endpoints and record["restart_count"] == 1
            assert record["pid"] == engine.pid, "the launcher's pid stays the supervisor's"

            restarting = health.wait_for(lambda m: m["state"] == "restarting", "restarting")
            assert restarting["restart_count"] == 1
            assert restarting["restart_reason"] == "killed by SIGKILL"
            assert restarting["pid"] == engine.pid
            assert not schema.missing_fields("health", restarting)
            back = health.wait_for(lambda m: m["pid"] == second, "from the restarted engine")
            assert back["restart_count"] == 1 and back["restart_reason"] == "killed by SIGKILL"
            last_of_first = max(i for i, m in enumerate(health.messages) if m["pid"] == first)
            assert last_of_first < health.index(restarting) < health.index(back)

            with EngineClient(endpoints["input"], endpoints["output"]) as client:
                out = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            assert out.finish_reason == "length" and len(out.output_token_ids) == 4
        finally:
            health.close()
        assert_gone(first)
    assert engine.child.returncode == 0
    assert_gone(second)
    # What `vconsole demo` says on exit: the restart, its reason, the log it kept; exit 1.
    assert (engine.restart_count, engine.restart_reason) == (1, "killed by SIGKILL")
    line, code = closing_line(engine)
    assert code == 1 and line == (f"engine restarted 1 times (last: killed by SIGKILL); "
                                  f"log: {engine.log_path}")
    assert engine.failed and engine.log_path.exists()


@pytest.mark.proc
@pytest.mark.slow
def test_sigterm_to_the_supervisor_stops_the_engine_and_leaves_no_process(tmp_path):
    engine = EngineProcess(ENGINE_ARGS, log_path=tmp_path / "engine.log")
    with engine:
        child = child_of(engine)
        assert child in {p.pid for p in psutil.Process(engine.pid).children()}
        with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
            rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=900, ignore_eos=True)
            first_token(client, rid)
            os.kill(engine.pid, signal.SIGTERM)     # the supervisor alone, not its group
            done = client.gather([rid], timeout_s=60)[rid]
        assert done.finish_reason == "abort", "a stop answers the request in flight"
        assert engine.child.wait(60) == 0
        assert_gone(child)
        assert not engine.ready_path.exists()
        assert "SIGTERM: stopping" in engine.log_text() and "died" not in engine.log_text()


@pytest.mark.long   # make test-long: giving up is RestartPolicy's, tested above; a live restart is the
# killed-engine test's
@pytest.mark.proc
@pytest.mark.slow
def test_an_engine_that_keeps_dying_is_given_up_after_max_restarts(tmp_path):
    engine = EngineProcess([*ENGINE_ARGS, "--max-restarts", "1", "--restart-backoff", "0.1"],
                           log_path=tmp_path / "engine.log")
    with engine:
        first = child_of(engine)
        os.kill(first, signal.SIGKILL)
        second = wait_for_new_child(engine, first)["child_pid"]
        os.kill(second, signal.SIGKILL)
        code = engine.child.wait(60)
        log = engine.log_text()
    assert code == exit_codes.GAVE_UP
    assert ("giving up: the engine failed 2 times within 300 s, more than --max-restarts 1 "
            "(last: killed by SIGKILL)") in log.splitlines()[-1]
    assert log.count("died: killed by SIGKILL; restart") == 1
    assert_gone(second)
    assert not engine.ready_path.exists()


@pytest.mark.proc
def test_an_engine_that_cannot_start_is_not_restarted(tmp_path):
    """A port that is taken: the child exits 2 at its bind, the supervisor at once, with the
    child's reason, and no second child is started."""
    busy = zmq.Context.instance().socket(zmq.ROUTER)
    busy.bind("tcp://127.0.0.1:*")
    taken = busy.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "vconsole", "engine", "--model", "tiny", "--input", taken,
             "--output", "tcp://127.0.0.1:*", "--telemetry", "tcp://127.0.0.1:*",
             "--control", "tcp://127.0.0.1:*", "--ready-file", str(tmp_path / "ready.json")],
            capture_output=True, text=True, timeout=120)
    finally:
        busy.close(0)
    assert run.returncode == exit_codes.CANNOT_START
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vconsole engine: the engine cannot start as configured "
                           "(exit code 2), so it is not restarted")
    assert f"cannot bind the input socket to {taken}" in last
    assert run.stderr.count("cannot bind the input socket") == 1, "said once, not twice"
    assert "died" not in run.stderr and not (tmp_path / "ready.json").exists()


@pytest.mark.proc
def test_no_supervisor_runs_the_engine_in_the_launched_process(tmp_path):
    engine = EngineProcess([*ENGINE_ARGS, "--no-supervisor"], log_path=tmp_path / "engine.log")
    with engine:
        record = read_ready_file(engine.ready_path)
        assert record is not None and record["pid"] == engine.pid
        # No engine child: its one child is its telemetry publisher process.
        children = psutil.Process(engine.pid).children()
        assert "supervised" not in record and [
            c for c in children if "publish.publisher_child" not in " ".join(c.cmdline())] == []
        assert len(children) == 1
    assert engine.child.returncode == 0


@pytest.mark.proc
def test_an_engine_that_never_became_ready_is_not_restarted(tmp_path):
    """A model that does not load fails the same way every time: the first start decides."""
    run = subprocess.run(
        [sys.executable, "-m", "vconsole", "engine", "--model", str(tmp_path / "no-model"),
         "--input", "tcp://127.0.0.1:*", "--output", "tcp://127.0.0.1:*",
         "--telemetry", "tcp://127.0.0.1:*", "--control", "tcp://127.0.0.1:*"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == exit_codes.FAILED
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vconsole engine: the engine failed before it was ever ready "
                           "(exit code 1), so it is not restarted")
    assert "no-model' does not exist" in last and "died" not in run.stderr
    assert run.stderr.count("does not exist") == 1, "the child's reason is printed once"


class Alerts(Health):
    """Every ``alert`` message on one endpoint (the same reconnecting SUB thread)."""

    TOPIC = b"alert"


@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.long   # make test-long: test_hang_stacks kills a hung engine, test_compile_liveness the idle stamp
def test_a_hung_engine_is_killed_and_restarted_but_an_idle_one_is_left_alone(tmp_path):
    """SIGSTOP freezes the child (alive, never stepping). Idle, it is left alone past the hang
    timeout; with a request in flight, the supervisor kills it and restarts it with reason
    ``hung: no step for N s``, and the restart goes out as an ``engine_restart`` event."""
    engine = EngineProcess([*ENGINE_ARGS, "--hang-timeout", "2", "--restart-backoff", "1"],
                           log_path=tmp_path / "engine.log")
    with engine:
        first = child_of(engine)
        alerts = Alerts(engine.endpoints["telemetry"])
        try:
            os.kill(first, signal.SIGSTOP)          # idle: waiting for work is not a hang
            time.sleep(4)
            os.kill(first, signal.SIGCONT)
            assert child_of(engine) == first and psutil.pid_exists(first)
            with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
                rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=900, ignore_eos=True)
                first_token(client, rid)
                os.kill(first, signal.SIGSTOP)
                record = wait_for_new_child(engine, first)
            assert record["restart_count"] == 1
            assert record["restart_reason"].startswith("hung: no step for ")
            event = alerts.wait_for(lambda m: m["name"] == "engine_restart", "engine_restart")
            assert event["level"] == "critical" and event["value"] == 1
            assert "hung: no step for" in event["message"]
        finally:
            alerts.close()
        assert_gone(first)
        assert "is hung: no step for" in engine.log_text()
    assert engine.child.returncode == 0
