"""A fleet recorded into one file (each engine under its target's name) and played back as a
fleet: the same rows, the Fleet screen first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.llama_cpp_stub import LlamaServerStub
from support.sglang_metrics import SglangMetrics
from vconsole.commands.attach import _recorded_fleet
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.fleet import FleetScreen
from vconsole.console.sources.fleet.recording import recorded_targets, renamed
from vconsole.console.sources.stream import ReplaySource
from vconsole.telemetry import schema
from vconsole.telemetry.record import Recorder, read_records

pytestmark = [pytest.mark.proc, pytest.mark.slow]


def test_a_renamed_message_keeps_its_buffers():
    blocks = np.arange(12, dtype=np.uint8) % 4
    body = {**schema.make_envelope("engine-0", 0, 5, 1.0), "usage": 0.5,
            "block_states": blocks}
    msg = schema.decode(renamed(schema.encode("kv", body), "ours-a"))
    assert (msg.engine, msg.seq, msg.payload["usage"]) == ("ours-a", 5, 0.5)
    assert (msg.block_states() == blocks).all()


@pytest.fixture
def recording(tmp_path) -> tuple[Path, dict[str, str]]:
    sg, ll = SglangMetrics(), LlamaServerStub(slots=2, n_ctx=1000)
    sg.step(running=5, waiting=9, used_tokens=40_000, prompt=10, generation=10, finished=1)
    ll.busy(0, prompt=100, decoded=100)
    sg_url, ll_url = sg.serve(), ll.serve()
    path = tmp_path / "fleet.vrec"
    try:
        r = subprocess.run([sys.executable, "-m", "vconsole", "record", str(path), "--target",
                            f"sglang={sg_url}", "--target", f"llama-cpp={ll_url}",
                            "--duration", "3"], capture_output=True, text=True, timeout=60)
    finally:
        sg.close()
        ll.close()
    assert r.returncode == 0, r.stderr
    assert "from 2 target(s)" in r.stdout
    return path, {sg_url.removeprefix("http://"): "sglang",
                  ll_url.removeprefix("http://"): "llama-cpp"}


def test_a_recorded_fleet_holds_each_target_under_its_name_and_kind(recording):
    path, kinds = recording
    targets, first = recorded_targets(path)
    assert {t.name: t.kind for t in targets} == kinds and first > 0


async def test_its_replay_opens_on_the_fleet_with_the_recorded_figures(recording):
    path, _ = recording
    source = ReplaySource(path, speed=0)
    fleet = _recorded_fleet(path, source)
    assert fleet is not None
    app = VConsoleApp(source=source, fleet=fleet)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.3)
        assert app.current_mode == "fleet"
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        rows = {r.kind: r for r in screen.rows.values()}
        assert (rows["sglang"].running, rows["sglang"].waiting) == (5, 9)
        assert rows["sglang"].kv_usage == 0.2
        assert rows["llama-cpp"].kv_usage == 0.1 and rows["llama-cpp"].kv_usage_estimated
        assert all(r.state == "up" for r in rows.values())    # at the recording's end


def test_a_recording_of_one_engine_is_no_fleet(recording, tmp_path):
    path, kinds = recording
    keep = next(name for name, kind in kinds.items() if kind == "sglang")
    one = tmp_path / "one.vrec"
    with Recorder(one) as rec:
        for ts, frames in read_records(path):
            head = schema.peek(frames)
            if head is not None and head[1] == keep:
                rec.write(frames, ts)
    assert _recorded_fleet(one, ReplaySource(one, speed=0)) is None
