"""The Alerts screen (`!`): every alert heard, newest first, the active ones on top, a filter
and the selected alert's whole message. Driven by Pilot over the recorded stream."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Static

from support.console_testing import frames, replay_app, until
from vconsole.console.engine_state import Alert
from vconsole.console.screens.alerts import AlertsScreen, figure, matches
from vconsole.console.widgets.chrome import TabBar

pytestmark = pytest.mark.slow


def text_of(widget: Static) -> str:
    return str(widget.render())


def test_figure_shows_the_value_against_its_threshold():
    a = Alert(1.0, "e", 0, "kv_usage", "warning", 0.9213, 0.9, "KV high")
    assert figure(a) == "0.921 / 0.9"
    assert figure(Alert(1.0, "e", 0, "engine_restart", "critical", 2, None, "x")) == "2"
    assert figure(Alert(1.0, "e", 0, "advice x", "ok", None, None, "x")) == ""


def test_every_filter_word_must_match_somewhere():
    a = Alert(1.0, "tiny-0", 1, "num_waiting", "critical", 120, 100, "queue is long")
    assert matches(a, ["waiting", "critical"]) and matches(a, ["tiny-0/1", "long"])
    assert not matches(a, ["waiting", "warning"])


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_bang_opens_every_alert_newest_first_with_its_tab(size):
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        heard = list(app.state.alerts)
        assert heard, "the recording carries alerts"
        await pilot.press("exclamation_mark")
        assert isinstance(app.screen, AlertsScreen)
        await pilot.pause()
        screen = app.screen
        table = screen.query_one("#alert-table", DataTable)
        assert table.row_count == len(heard)
        assert screen.shown[0] == heard[-1], "newest first"
        tabs = text_of(screen.query_one(TabBar))
        assert "! Alerts" in tabs, "the current screen's tab is named"
        summary = text_of(screen.query_one("#alert-summary"))
        assert f"{len(heard)} event" in summary
        detail = text_of(screen.query_one("#alert-detail"))
        assert heard[-1].name in detail and heard[-1].message[:30] in detail.replace("\n", " ")


async def test_the_filter_narrows_the_list_and_esc_brings_it_back():
    app = replay_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("exclamation_mark")
        await pilot.pause()
        screen = app.screen
        table = screen.query_one("#alert-table", DataTable)
        total = table.row_count
        names = {a.name for a in app.state.alerts}
        name = sorted(names)[0]
        await pilot.press("slash", *name)
        await pilot.pause()
        assert 0 < table.row_count <= total
        assert all(name in f"{a.name} {a.message}" for a in screen.shown)
        assert f"filter {name}" in text_of(screen.query_one("#alert-summary"))
        await pilot.press("enter", "escape")
        await pilot.pause()
        assert table.row_count == total and screen.filter_text == ""
        await pilot.press("slash", *"no-such-alert-anywhere", "enter")
        await pilot.pause()
        assert table.row_count == 0 and text_of(screen.query_one("#alert-detail")) == ""


async def test_the_help_names_the_alerts_key_on_its_first_line_and_in_its_own_section():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        lines = text_of(app.screen.query_one("#help-text")).splitlines()
        assert "scroll" in lines[0] and "esc" in lines[0], "how to reach what is below the fold"
        everywhere = next(line for line in lines if line.strip().startswith("1 2 3"))
        assert "!" in everywhere.split()[:8] and "Alerts" in everywhere
        assert any(line.strip() == "Alerts" for line in lines)


async def test_at_the_top_the_cursor_follows_the_newest_alert_elsewhere_it_stays_put():
    from support.console_testing import frames
    app = replay_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("exclamation_mark")
        await pilot.pause()
        screen = app.screen
        eng = app.state.engine()
        t0 = max(a.recv_ts for a in app.state.alerts)

        def fire(i: int, name: str) -> None:
            app.state.ingest(frames("alert", {"name": name, "level": "warning", "value": 0.9,
                                              "threshold": 0.8, "message": f"{name} is high"},
                                    seq=10_000 + i, engine=eng.engine), t0 + i)
            app.refresh_view(force=True)

        fire(1, "kv_usage")
        await pilot.pause()
        assert screen.selected().name == "kv_usage", "at the top: the newest"
        await pilot.press("down")
        picked = screen.selected()
        fire(2, "gpu_memory")
        await pilot.pause()
        assert screen.shown[0].name == "gpu_memory"
        assert screen.selected() == picked, "moved down: it stays on its alert"


T0 = 1_700_000_000.0
CLEARED = "median step time of the last 5 s back to 311 ms (under 450 ms for 20 s: ...)"


def beat(ts: float, seq: int, active: dict[str, str]) -> tuple[float, list]:
    return ts, frames("health", {"state": "running", "uptime_s": 60.0, "steps": 900,
                                 "interval_s": 1.0, "alerts_active": active}, seq=seq, ts=ts)


def edge(ts: float, seq: int, name: str, level: str, previous: str, value: float,
         message: str) -> tuple[float, list]:
    return ts, frames("alert", {"name": name, "level": level, "previous": previous,
                                "value": value, "threshold": 0.5, "message": message},
                      seq=seq, ts=ts)


async def test_active_now_agrees_with_a_change_heard_after_the_last_heartbeat():
    # A level change goes out at once, the heartbeat once a second: a frame between the two
    # (live for up to a second, a replay paused there for good) has a heartbeat that still
    # names the cleared step-time alert, and a new waiting alert it does not name yet.
    records = [
        edge(T0, 0, "step_time", "warning", "ok", 0.62, "median step time ... is 620 ms"),
        beat(T0 + 0.1, 0, {"step_time": "warning"}),
        edge(T0 + 0.5, 1, "step_time", "ok", "warning", 0.311, CLEARED),
        edge(T0 + 0.6, 2, "waiting", "warning", "ok", 55, "waiting requests is 55"),
    ]
    app = replay_app(records=records)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: len(app.state.alerts) == 3)
        app.refresh_view(force=True)
        await pilot.pause()
        overview = text_of(app.screen.query_one("#alerts"))
        assert "back to 311 ms" in overview
        assert "● step_time" not in overview and "● waiting warning" in overview
        await pilot.press("exclamation_mark")
        await pilot.pause()
        summary = text_of(app.screen.query_one("#alert-summary"))
        assert "1 active" in summary and "waiting warning" in summary
        assert "step_time" not in summary
    # The next heartbeat says the same, and a change older than it is already counted in it.
    state = app.state
    eng = state.engine()
    state.feed([beat(T0 + 1.1, 1, {"waiting": "warning"})])
    assert state.alerts_active(eng) == {"waiting": "warning"}
    state.feed([beat(T0 + 2.1, 2, {})])       # cleared: its ok event was lost on the way
    assert state.alerts_active(eng) == {}
