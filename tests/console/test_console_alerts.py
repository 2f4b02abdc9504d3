"""The Alerts screen (`!`): every alert heard, newest first, the active ones on top, a filter
and the selected alert's whole message. Driven by Pilot over the recorded stream."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Static

from support.console_testing import replay_app
from vconsole.console.screens.alerts import AlertsScreen, figure, matches
from vconsole.console.state import Alert
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
