"""Subscribers of the real publisher: the copyable example and `vconsole top`."""

import argparse
import ast
import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import zmq

import vconsole.telemetry.subscriber as example
from vconsole.commands import top as top_cmd
from vconsole.engine.latency import LatencyLog
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import KVStats, RequestRow, SchedulerStats, StepStats
from vconsole.tools import top
from vconsole.wire import control


def start_engine_side(ctx, **cfg):
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "engine-3", 1,
                             EngineConfig(heartbeat_interval_s=0.1, **cfg))
    pub.start()
    pub.record_step(StepStats(10, 20, 30, 60, 4, 1, 1))
    states = np.array([1, 1, 1, 3, 2, 2, 0, 0, 0, 0], np.uint8)
    pub.submit_snapshot(
        SchedulerStats(2, 1, 0, 0, 64, 512, "fcfs",
                       requests=[RequestRow("a", "running", 0, 8, 1, 1, 0.1)]),
        KVStats(10, 16, 4, 4, 2, 1, 0.4, 0.3, 0.1, 10, 5, states), "running", 1)
    pub.submit_latency(LatencyLog().drain(1.0, 60.0))
    return pub


def test_example_uses_only_pyzmq_and_msgpack():
    tree = ast.parse(Path(example.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"zmq", "msgpack", "sys", "contextlib"}, imported


def test_example_prints_a_line_per_real_message(ctx):
    pub = start_engine_side(ctx)
    out = io.StringIO()
    try:
        n, lost = example.run(pub.endpoint, count=12, timeout_s=3, out=out)
    finally:
        pub.close()
    lines = out.getvalue().splitlines()
    assert n == 12 and len(lines) == 12 and lost == 0
    assert all(" engine-3/1 seq=" in line for line in lines)
    health = [line for line in lines if line.startswith("health ")]
    assert health and ("state=idle" in health[0] or "state=running" in health[0])
    kv = [line for line in lines if line.startswith("kv ")]
    assert not kv or kv[0].endswith("+10B raw")


class ControlStub:
    """Answers get_config the way the engine's ROUTER will."""

    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.asked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.asked += 1
                self.sock.send_multipart(control.handle_frames(
                    frames, lambda req: control.config_reply(9, EngineConfig().to_dict())))
        self.sock.close(0)

    def close(self):
        self.stop.set()
        self.thread.join(2)


def test_top_once_json_prints_every_topic(ctx, capsys, monkeypatch):
    monkeypatch.setattr(top, "CONFIG_GRACE_S", 0.3)
    # Config is announced only at start, long before `top` subscribes: top must ask control.
    pub = start_engine_side(ctx, config_interval_s=600)
    stub = ControlStub(ctx)
    deadline = time.monotonic() + 3
    while not pub.sent["config"] and time.monotonic() < deadline:  # the announcement is gone
        time.sleep(0.01)
    try:
        args = argparse.Namespace(telemetry=pub.endpoint, control=stub.endpoint, once=True,
                                  json=True, timeout=5.0)
        rc = top_cmd.main(args)
    finally:
        pub.close()
        stub.close()
    out, err = capsys.readouterr()
    assert rc == 0, err
    snap = json.loads(out)
    assert set(snap) >= {"health", "step", "sched", "kv", "gpu", "host", "config"}
    assert snap["config"]["source"] == "control" and snap["config"]["version"] == 9
    assert stub.asked == 1
    assert snap["sched"]["requests"][0]["id"] == "a"
    bs = snap["kv"]["block_states"]
    assert bs["counts"] == {"free": 4, "used": 3, "cached": 2, "shared": 1}
    assert bs["runs"] == [[1, 3], [3, 1], [2, 2], [0, 4]]


def test_top_once_without_an_engine_fails_clearly(capsys):
    args = argparse.Namespace(telemetry="tcp://127.0.0.1:1", control="tcp://127.0.0.1:1",
                              once=True, json=True, timeout=0.5)
    assert top_cmd.main(args) == 1
    err = capsys.readouterr().err
    assert "no complete telemetry from tcp://127.0.0.1:1" in err and "health" in err


def test_block_summary_omits_long_run_lists():
    s = top.summarise_blocks(np.tile(np.array([0, 1], np.uint8), 100))
    assert s["counts"]["free"] == 100 and s["runs"] is None and "200 runs" in s["note"]
    assert top.summarise_blocks(np.zeros(0, np.uint8))["runs"] == []
