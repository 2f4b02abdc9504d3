"""What-if against a real engine: its own trace, fetched by the console over the control channel
(``get_trace``), predicts a max_num_seqs change in the confirmation box at 80x24. The operator
cancels: the shared engine's config is never changed. And ``c`` on the What-if screen
calibrates: ``vconsole whatif --calibrate`` on an engine of its own, reported when done."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from textual.widgets import Static

from support.console_testing import FakeControl, replay_app, until
from vconsole.console.app import VConsoleApp
from vconsole.console.predictions import SHOWN, WhatIf, figure
from vconsole.console.screens.whatif import WhatIfScreen
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.engine.client.client import EngineClient
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.request_trace import (
    RequestRecord,
    Trace,
    TraceHeader,
    parse_lines,
    read_trace,
    trace_lines,
)
from vconsole.whatif.cost_model import StepCostModel
from vconsole.whatif.simulate import simulate
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]

REQUESTS = 30


def serve(proc, n: int) -> int:
    """``n`` short requests, all at once; how many finished."""
    with EngineClient(proc.endpoints["input"], proc.endpoints["output"]) as c:
        for i in range(n):
            c.submit(prompt_token_ids=[5 + i % 50] * (8 + i % 24), max_tokens=6 + i % 10,
                     ignore_eos=True)
        done = c.gather(timeout_s=60)
    return sum(1 for d in done.values() if d.finished)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An engine of this module's own: the session's shared one keeps every earlier test's
    requests for 5 minutes (over a thousand in CI), and the box's prediction over that trace
    took more than 30 s on a loaded machine. This trace holds this module's requests only."""
    from support.live_engine import ipc_endpoints
    from vconsole.engine.launch.engine_process import EngineProcess

    d = tmp_path_factory.mktemp("whatif-engine")
    args = ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "8"]
    with EngineProcess(args, endpoints=ipc_endpoints(d),
                       log_path=d / "engine.log") as proc:
        yield proc


async def test_the_box_predicts_from_a_live_engines_own_trace(engine):
    assert await asyncio.to_thread(serve, engine, REQUESTS) == REQUESTS
    control = engine.endpoints["control"]
    with ControlClient(control, timeout_s=10) as c:
        before = c.get_config()["values"]
        text = c.get_trace()
    want = WhatIf(lambda: text).predict([{"max_num_seqs": 4}])[0]
    assert want.ready, want.headline()
    assert want.trace.requests == REQUESTS
    app = VConsoleApp(telemetry_endpoints=[engine.endpoints["telemetry"]],
                      control_endpoint=control)
    assert app.whatif.available
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None,
                    timeout=15)
        assert app.request_change("max_num_seqs", "4") is None        # 8 → 4: asks first
        await pilot.pause()
        box = app.screen
        assert isinstance(box, ConfirmScreen)
        forecast = box.query_one("#confirm-forecast", Static)
        await until(pilot, lambda: "predicting" not in str(forecast.render()), timeout=30)
        shown = str(forecast.render())
        assert shown.startswith("predicted from the engine's last"), shown
        assert f"last {REQUESTS} requests" in shown
        for key in SHOWN:   # the same trace (no traffic since): the same figures
            assert f"{figure(key, want.before[key])} → {figure(key, want.after[key])}" in shown
        assert box.query_one("#confirm").region.bottom <= 24
        await pilot.press("escape")
    with ControlClient(control, timeout_s=10) as c:
        assert c.get_config()["values"]["max_num_seqs"] == before["max_num_seqs"]


# --- calibrating from the What-if screen -------------------------------------------------------

SMALL = EngineConfig(num_kv_blocks=48, max_num_seqs=2, max_num_batched_tokens=64)


def small_trace() -> str:
    """30 requests on `tiny` with 2 seats and a 48-block pool: a grid of a dozen probes."""
    header = TraceHeader(model="tiny", block_size=SMALL.block_size, num_kv_blocks=48,
                         vocab_size=256, max_model_len=256, config=SMALL.to_dict())
    rng, t, reqs = random.Random(3), 0.0, []
    for _ in range(30):
        t += rng.expovariate(20.0)
        out = rng.randint(8, 24)
        reqs.append(RequestRecord(arrival=t, finish=t, prompt_len=rng.randint(16, 64),
                                  output_len=out, max_tokens=out, ignore_eos=True))
    cost = StepCostModel({"const": 0.002, "prefill": 2e-5, "decode": 4e-4, "context": 1e-7,
                          "prefill_attn": 0.0, "new_reqs": 2e-4},
                         {"const": 0.0005, "reqs": 1e-5}, 0)
    ran = simulate(Trace(header, reqs), SMALL, 48, cost, max_model_len=256, vocab_size=256)
    return "".join(trace_lines(Trace(header, ran.requests, ran.steps)))


class SmallEngine(FakeControl):
    """The watched engine: its config and its trace; it must see nothing but reads."""

    def __init__(self) -> None:
        super().__init__(SMALL)
        self.text = small_trace()

    def get_trace(self, window_s: float | None = None) -> str:
        self.calls.append(("get_trace", None))
        return self.text


def read_lines(text: str) -> Trace:
    return parse_lines(text.splitlines(keepends=True), "trace")


def notes(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_c_calibrates_on_an_engine_of_its_own_and_the_prediction_uses_it(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CALIBRATIONS", str(tmp_path))
    ctl = SmallEngine()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None)
        await pilot.press("w")
        screen = app.screen
        assert isinstance(screen, WhatIfScreen)
        await until(pilot, lambda: screen.result is not None and screen.result.ready,
                    timeout=30)
        summary = screen.query_one("#wi-summary", Static)
        assert "no calibration" in str(summary.render())
        await pilot.press("c")
        assert any(n.startswith("Calibrating: vconsole whatif --calibrate") for n in notes(app))
        await until(pilot, lambda: "probes x 2 on an engine of tiny" in str(summary.render()),
                    timeout=60)
        assert "calibrating… " in str(summary.render())       # its progress, on the screen
        await pilot.press("c")                                  # a second press says so
        assert any("already running" in n for n in notes(app))
        await until(pilot, lambda: any(n.startswith("Calibrated") for n in notes(app)),
                    timeout=240)
        done = next(n for n in notes(app) if n.startswith("Calibrated"))
        assert "steps, kept in" in done and str(tmp_path) in done
        await until(pilot, lambda: screen.result.ready and screen.result.trace.calibration
                    .startswith("calibrated "), timeout=60)
        assert "calibrated " in str(summary.render())
    (calib,) = tmp_path.glob("*.calib.jsonl")
    assert read_trace(calib).header.model == "tiny" and read_trace(calib).steps
    assert {op for op, _ in ctl.calls} <= {"get_config", "get_trace"}   # the live engine: reads


def running_with(text: str) -> list[str]:
    """Command lines of this machine's processes that name ``text``."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            out.append(cmd)
    return out


def test_a_calibration_cancelled_midway_stops_its_engine_and_leaves_no_file(tmp_path):
    """Cancelled (the console quits) once the probe engine is up: the command gets SIGINT,
    stops its engine on the way out, and half a grid is never kept."""
    calibrator = WhatIf(None).calibrator
    said: list[str] = []

    def probing() -> bool:        # the probe engine writes its trace once it is serving
        return any(p.name.endswith(".calib.jsonl") for p in tmp_path.iterdir())

    done = calibrator.run(read_lines(small_trace()), tmp_path, {}, progress=said.append,
                          cancelled=probing)
    assert not done.ok and done.message == "calibration cancelled"
    assert said and said[0].startswith("calibrating: ")
    assert list(tmp_path.iterdir()) == []     # never the newest calibration: none at all
    assert not calibrator.running
    deadline = time.monotonic() + 30
    while running_with(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_with(str(tmp_path)) == []  # no probe engine left behind
