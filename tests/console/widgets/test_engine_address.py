"""The header names where the console's engine is when the app is told (`vconsole demo`: its
base address, what another shell's ``$VCONSOLE_BASE_PORT`` must name), at 80x24 too."""

from __future__ import annotations

import pytest
from textual.widgets import Static

from support.console_testing import RECORDING, FakeControl, replay_app
from vconsole.console.app import VConsoleApp
from vconsole.console.widgets.chrome import TabBar
from vconsole.telemetry.record import read_records

pytestmark = pytest.mark.slow

END = max(ts for ts, _ in read_records(RECORDING))


def text_of(widget: Static) -> str:
    return str(widget.render())


def live_app(tmp_path) -> VConsoleApp:
    """A live console as the demo starts it: writable, its engine's address given."""
    return VConsoleApp(telemetry_endpoints=[f"ipc://{tmp_path}/engine"], control=FakeControl(),
                       clock=lambda: END, engine_address="127.0.0.1:5570")


async def test_the_header_shows_the_engines_address_while_it_waits_for_telemetry(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        bar = text_of(app.screen.query_one(TabBar))
        assert "127.0.0.1:5570 ● waiting for telemetry" in bar and "1 Overview" in bar


@pytest.mark.parametrize(("size", "shown"), [((120, 40), " tiny-0 127.0.0.1:5570 ● running"),
                                             ((80, 24), " tiny-0 127.0.0.1:5570 ● running"),
                                             ((72, 24), "  127.0.0.1:5570 ● running hb")])
async def test_the_engines_name_goes_before_its_address_where_the_width_runs_out(
        tmp_path, size, shown):
    app = live_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        with app.state.lock:                 # the engine's telemetry, as the reader folds it
            app.state.feed(read_records(RECORDING))
        app.refresh_view(force=True)
        await pilot.pause()
        bar = text_of(app.screen.query_one(TabBar))
        assert shown in bar and "1 Overview" in bar


async def test_without_an_address_the_header_is_as_before():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "127.0.0.1" not in text_of(app.screen.query_one(TabBar))
