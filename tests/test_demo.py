"""`vconsole demo`'s process management: the stack comes up, serves, and leaves nothing behind —
on a normal exit and when the console crashes. No terminal needed: the console is faked."""

import sys
import time
import types

import psutil
import pytest
import zmq

from console import demo
from console.demo import DemoStack, engine_args_from
from telemetry import schema
from vconsole.cli import build_parser

ENGINE_ARGS = ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "8"]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.05)


def test_engine_args_pass_flags_through_with_demo_defaults():
    args = build_parser().parse_args(["demo", "--max-num-seqs", "4", "--set", "log_stats=true"])
    out = engine_args_from(args)
    assert out[out.index("--max-num-seqs") + 1] == "4"
    assert out[out.index("--num-kv-blocks") + 1] == "256"
    assert out[-2:] == ["--set", "log_stats=true"]
    args = build_parser().parse_args(["demo", "--config", "e.toml"])
    assert engine_args_from(args) == ["--config", "e.toml"]  # the file decides


def test_stack_serves_load_with_telemetry_and_leaves_no_process_behind():
    before = children()
    with DemoStack(ENGINE_ARGS, rate=20.0) as stack:
        pid = stack.engine.pid
        assert pid in children()
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"sched")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(stack.endpoints["telemetry"])
        deadline = time.monotonic() + 20
        busy = False
        while not busy and time.monotonic() < deadline:
            if sub.poll(200):
                s = schema.decode(sub.recv_multipart()).payload
                busy = s["num_running"] > 0 or s["num_finished_total"] > 0
        sub.close()
        assert busy, "the load never reached the engine"
        assert stack.load.is_alive() and stack.load.error is None
    assert not stack.load.is_alive()
    assert stack.engine.proc.returncode == 0  # SIGTERM: a clean drain
    assert_gone(pid)
    assert children() <= before


def test_a_crashing_console_still_stops_everything(monkeypatch):
    started: list[DemoStack] = []
    real_start = DemoStack.start

    def spy_start(self):
        started.append(self)
        return real_start(self)

    class CrashingApp:
        def __init__(self, telemetry_endpoints, control_endpoint, **kw):
            assert telemetry_endpoints[0].startswith("tcp://127.0.0.1:")
            assert control_endpoint.startswith("tcp://127.0.0.1:")

        def run(self):
            raise RuntimeError("console crashed")

    monkeypatch.setitem(sys.modules, "console.app", types.SimpleNamespace(VConsoleApp=CrashingApp))
    monkeypatch.setattr(DemoStack, "start", spy_start)
    args = build_parser().parse_args(["demo", *ENGINE_ARGS, "--rate", "5"])
    before = children()
    with pytest.raises(RuntimeError, match="console crashed"):
        demo.main(args)
    (stack,) = started
    assert_gone(stack.engine.pid)
    assert not stack.load.is_alive()
    assert children() <= before
