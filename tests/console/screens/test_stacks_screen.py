"""The Stacks screen (``S``): the engine process's threads and their stacks, the busy loop's on
top, read again every couple of seconds; and the Alerts screen naming where a hung engine hung.
Pilot at 80x24 against a real engine process (the session's shared one)."""

from __future__ import annotations

import pytest
from textual.widgets import Static

from support.console_testing import frames, replay_app, until
from support.remote_engine import remote_engine_beats
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.alerts import AlertsScreen
from vconsole.console.screens.stacks import StacksScreen
from vconsole.console.widgets.chrome import TabBar
from vconsole.shared import stacks

pytestmark = pytest.mark.slow


def text_of(screen, selector: str) -> str:
    return str(screen.query_one(selector, Static).render())


@pytest.mark.proc
async def test_s_shows_the_live_engines_threads_with_the_busy_loop_on_top(shared_engine):
    app = VConsoleApp(telemetry_endpoints=[shared_engine.endpoints["telemetry"]],
                      control_endpoint=shared_engine.endpoints["control"])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("S")
        assert isinstance(app.screen, StacksScreen)
        screen = app.screen
        await until(pilot, lambda: screen.report is not None or screen.error, timeout=20)
        assert screen.error is None, screen.error
        first = screen.report
        assert first.pid == shared_engine.ready["child_pid"]
        body = text_of(screen, "#stacks-text")
        assert body.splitlines()[0].startswith("MainThread busy loop")
        assert "run_busy_loop" in body and "engine-output" in body
        summary = text_of(screen, "#stacks-summary")
        assert f"pid {first.pid}" in summary and f"by {first.method}" in summary
        await pilot.press("r")                      # read again now, not in 2 s
        await until(pilot, lambda: screen.report is not first, timeout=1.5)


async def test_a_recording_has_no_stacks_and_says_so():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("S")
        await pilot.pause()
        assert "a recording has none" in text_of(app.screen, "#stacks-summary")


def highlighted(bar: TabBar) -> list[str]:
    """The tab bar's text in reverse video: the current screen's tab."""
    content = bar.render()
    return [content.plain[s.start:s.end] for s in content.spans if "reverse" in str(s.style)]


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_stacks_screen_highlights_its_tab_while_shown(size):
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        assert highlighted(app.screen.query_one(TabBar)) == [" 1 Overview "]
        assert "S Stacks" not in str(app.screen.query_one(TabBar).render())  # a tool: no tab
        await pilot.press("S")
        await pilot.pause()
        assert isinstance(app.screen, StacksScreen)
        assert highlighted(app.screen.query_one(TabBar)) == [" S Stacks "]


async def test_a_digit_without_a_screen_says_so_instead_of_nothing():
    app = replay_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        before = app.screen
        await pilot.press("7")
        await pilot.pause()
        assert app.screen is before
        (note,) = list(app._notifications)
        assert note.message.startswith("7 opens no screen") and "? lists every key" in note.message
        await pilot.press("3", "0")          # the KV map's own 0 (zoom to fit) still wins
        await pilot.pause()
        assert len(app._notifications) == 1


async def test_a_hung_engines_restart_alert_shows_where_it_hung(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))    # the hang folder: tmp_path/stacks
    report = stacks.StackReport(4242, stacks.PY_SPY, stacks.ordered([
        stacks.ThreadStack("engine-output", 2, (stacks.Frame("run", "/x/output_thread.py", 9),)),
        stacks.ThreadStack("MainThread", 1, (
            stacks.Frame("hang_here", "/x/vconsole/engine/core.py", 12),
            stacks.Frame("EngineCoreProc.run_busy_loop", "/x/vconsole/engine/process/x.py", 3),
        ))]))
    path = stacks.hang_dir() / "hang-e-4242-20260101T000000.txt"
    path.parent.mkdir()
    path.write_text(report.render())
    message = f"engine restarting (1): hung: no step for 3 s in hang_here; stacks: {path}"
    alert = frames("alert", {"name": "engine_restart", "level": "critical", "previous": "ok",
                             "value": 1.0, "threshold": 0.0, "message": message})
    app = replay_app(records=[(0.0, alert)])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("exclamation_mark")
        await pilot.pause()
        assert isinstance(app.screen, AlertsScreen)
        detail = text_of(app.screen, "#alert-detail")
        assert "stacks:" in detail and path.name in detail.replace("\n", "")
        assert "busy loop: hang_here (vconsole/engine/core.py:12)" in detail.replace("\n", " ")


async def test_a_remote_engines_pid_is_not_read_here(tmp_path):
    """The health of an engine on another machine names a pid that exists here (this test's
    own): the screen says where to read its stacks instead of showing this process."""
    import os

    endpoint = f"ipc://{tmp_path}/telemetry"
    with remote_engine_beats(endpoint) as body:
        assert body["pid"] == os.getpid()
        app = VConsoleApp(telemetry_endpoints=[endpoint])
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("S")
            screen = app.screen
            assert isinstance(screen, StacksScreen)
            await until(pilot, lambda: screen.report is not None or screen.error, timeout=20)
            assert screen.report is None
            assert "the engine runs on gpu-node-7, not here" in (screen.error or "")
            await pilot.pause()
            assert "run vconsole stacks there" in text_of(screen, "#stacks-summary").replace(
                "\n", " ")
