"""Steering in a fleet: drilled into one of our engines, the console changes that engine's
config (behind the usual confirmation box, with its own control key); drilled into another
kind, it is read-only and says why; before any drill-in, nothing is steered."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from support.console_testing import until
from support.ports import free_bases, free_block
from support.sglang_metrics import SglangMetrics
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.fleet import FleetScreen
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.fleet.snapshot import build_sources
from vconsole.console.sources.fleet.targets import make_target
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.engine.launch.engine_process import EngineProcess, loopback_endpoints
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]
BASE, SGLANG_PORT = free_bases(2, 4)[0], free_block(1)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Iterator[tuple[EngineProcess, list]]:
    work = tmp_path_factory.mktemp("fleet-steer")
    eng = EngineProcess(["--model", "tiny", "--num-kv-blocks", "32", "--max-num-seqs", "8",
                         "--set", "heartbeat_interval_s=0.2"],
                        endpoints=loopback_endpoints(BASE), log_path=work / "engine.log")
    sg = SglangMetrics()
    sg.step(running=1, waiting=0, used_tokens=10)
    sg.serve(SGLANG_PORT)
    try:
        eng.start(timeout_s=120)
        yield eng, [make_target("vconsole", f"127.0.0.1:{BASE}", name="ours"),
                    make_target("sglang", f"127.0.0.1:{SGLANG_PORT}", name="sg")]
    finally:
        eng.stop(grace_s=5)
        sg.close()


def max_num_seqs(eng: EngineProcess) -> int:
    with ControlClient(eng.endpoints["control"], timeout_s=5) as c:
        return int(c.get_config()["values"]["max_num_seqs"])


async def drill(pilot, app: VConsoleApp, name: str) -> None:
    if app.current_mode != "fleet":
        await pilot.press("F")
        await until(pilot, lambda: app.current_mode == "fleet")
    screen = app.screen
    assert isinstance(screen, FleetScreen)
    await until(pilot, lambda: name in screen.row_keys and screen.rows[name].state == "up",
                timeout=20)
    screen.table.move_cursor(row=screen.row_keys.index(name))
    await pilot.press("enter")
    await until(pilot, lambda: app.current_mode == "overview")


async def test_drilled_into_ours_a_change_is_asked_then_sent_to_that_engine(targets):
    eng, ts = targets
    sources, _ = build_sources(ts)
    app = VConsoleApp(sources=sources, fleet=Fleet(sources, started=time.time()))
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.readonly and "drill into one of our engines" in app.readonly_reason
        await drill(pilot, app, "sg")
        assert app.readonly and "SGLang" in app.readonly_reason
        await drill(pilot, app, "ours")
        await until(pilot, lambda: not app.readonly, timeout=10)
        await until(pilot, lambda: app.state.config is not None
                    and "max_num_seqs" in app.state.config.values, timeout=10)
        app.request_change("max_num_seqs", "3")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert max_num_seqs(eng) == 8                    # nothing sent before the answer
        await pilot.pause(0.2)
        await pilot.press("tab", "enter")              # to "Apply change", and press it
        deadline = time.monotonic() + 10
        while max_num_seqs(eng) != 3 and time.monotonic() < deadline:
            await pilot.pause(0.2)
        assert max_num_seqs(eng) == 3


async def test_e_changes_every_engine_of_ours_after_one_box_listing_them(targets):
    eng, ts = targets
    sources, _ = build_sources(ts)
    app = VConsoleApp(sources=sources, fleet=Fleet(sources, started=time.time()))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FleetScreen)
                    and len(app.screen.row_keys) == 2)
        await pilot.press("e")
        await pilot.pause(0.2)
        await pilot.press(*"max_num_seqs=5", "enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        box = app.screen
        assert f"ours  tcp://127.0.0.1:{BASE}" in box.consequence
        assert "not touched: sg (sglang: watched only)" in box.consequence
        assert max_num_seqs(eng) != 5                    # nothing sent before the answer
        await pilot.pause(0.2)
        await pilot.press("tab", "enter")
        deadline = time.monotonic() + 10
        while max_num_seqs(eng) != 5 and time.monotonic() < deadline:
            await pilot.pause(0.2)
        assert max_num_seqs(eng) == 5
