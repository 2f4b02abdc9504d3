"""The control server on its own (no engine process): a set_config is applied only by whoever
runs the queued call (the busy loop), an unauthorised one is never queued, every request gets
one reply, and the key file lives exactly as long as the server's thread."""

import queue
import threading

import pytest
import zmq

from vconsole.engine.process import control_server
from vconsole.engine.process.control_server import ControlCall, ControlServer
from vconsole.security import engine_key
from vconsole.security.control_key import load_control_key
from vconsole.shared.config import EngineConfig, apply_update
from vconsole.wire import control
from vconsole.wire.control_client import ControlClient, NotAuthorised


class BusyLoop:
    """Stands in for EngineCoreProc: holds the config, applies queued calls when told to."""

    def __init__(self) -> None:
        self.version, self.config = 1, EngineConfig()
        self.calls: queue.SimpleQueue[ControlCall] = queue.SimpleQueue()

    def view(self) -> tuple[int, EngineConfig]:
        return self.version, self.config

    def apply(self, values, request_id):
        update = apply_update(self.config, values)
        if update.applied:
            self.version, self.config = self.version + 1, update.config
        return control.config_reply(self.version, self.config.to_dict(), update,
                                    request_id=request_id)

    def step_boundary(self, timeout: float = 5.0) -> None:
        self.calls.get(timeout=timeout).run(self.apply)


@pytest.fixture
def served(tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/control"
    sock.bind(endpoint)
    loop, stop = BusyLoop(), threading.Event()
    server = ControlServer(sock, endpoint, key_file=tmp_path / "control.key",
                           config_view=loop.view, submit=loop.calls.put, stop=stop, poll_ms=20)
    server.start()
    yield server, loop, endpoint
    stop.set()
    server.join(5)
    assert not server.is_alive()
    ctx.destroy(linger=0)


def test_set_config_is_applied_by_the_busy_loop_and_answered_once_applied(served):
    server, loop, endpoint = served
    key = load_control_key(endpoint, server.key_file)
    with ControlClient(endpoint, key=key) as ctl:
        assert ctl.get_config()["version"] == 1   # answered without the busy loop
        worker = threading.Thread(target=loop.step_boundary)
        worker.start()
        reply = ctl.set_config({"max_num_seqs": 3})
        worker.join()
        assert reply["ok"] and reply["applied"] == {"max_num_seqs": 3} and reply["version"] == 2
        assert ctl.get_config()["values"]["max_num_seqs"] == 3


def test_an_unauthorised_set_config_is_never_queued(served):
    server, loop, endpoint = served
    for key in (None, engine_key.new_key()):
        with ControlClient(endpoint, key=key) as ctl, pytest.raises(NotAuthorised):
            ctl.set_config({"max_num_seqs": 3})
    assert loop.calls.empty() and loop.version == 1


def test_a_call_the_busy_loop_never_reached_is_answered_and_never_applied(served, monkeypatch):
    monkeypatch.setattr(control_server, "CONTROL_WAIT_S", 0.2)
    server, loop, endpoint = served
    with ControlClient(endpoint, key=load_control_key(endpoint, server.key_file)) as ctl:
        reply = ctl.request("set_config", {"max_num_seqs": 3})
    assert not reply["ok"] and "did not reach a step boundary" in reply["error"]
    loop.step_boundary()          # the busy loop comes round too late: the call was cancelled
    assert loop.version == 1 and loop.config.max_num_seqs != 3


def test_the_key_file_is_private_and_removed_when_the_thread_stops(tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    stop = threading.Event()
    server = ControlServer(sock, "ipc://unused", key_file=tmp_path / "k.key",
                           config_view=BusyLoop().view, submit=lambda call: None, stop=stop,
                           poll_ms=20)
    assert server.key_file.stat().st_mode & 0o777 == 0o600
    assert len(server.key_file.read_text().strip()) == 2 * engine_key.KEY_BYTES
    server.start()
    stop.set()
    server.join(5)
    assert not server.key_file.exists()
    ctx.destroy(linger=0)
