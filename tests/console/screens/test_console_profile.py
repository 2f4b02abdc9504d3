"""The Profile view driven by Pilot against `FakeControl`'s profile ops (the engine's shapes)."""

from __future__ import annotations

import pytest

from support.console_testing import FakeControl, replay_app, until
from vconsole.console.palette import ConsoleCommands
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.profile import ProfileScreen
from vconsole.console.widgets.confirmation import ConfirmScreen

pytestmark = pytest.mark.slow

PALETTE_ENTRY = "Profile the engine's next steps"


def text_of(screen, selector: str) -> str:
    return str(screen.query_one(selector).render())


def starts(ctl: FakeControl) -> list:
    return [c for c in ctl.calls if c[0] == "profile_start"]


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_a_confirmed_profile_shows_progress_then_the_tables(size):
    ctl = FakeControl()
    ctl.profile_hold = True
    app = replay_app(control=ctl)
    async with app.run_test(size=size) as pilot:
        await pilot.press("P")
        screen = app.screen
        assert isinstance(screen, ProfileScreen)
        await pilot.pause()
        assert "s profiles the next 20 steps" in text_of(screen, "#prof-summary")
        assert "P Profile" in text_of(screen, "#tabbar")
        await pilot.press("plus")
        await pilot.pause()
        assert "the next 50 steps" in text_of(screen, "#prof-summary")
        await pilot.press("minus")

        await pilot.press("s")                     # asks first; enter is on Cancel
        assert isinstance(app.screen, ConfirmScreen)
        assert "slower" in app.screen.consequence
        assert app.screen.title_text == "Profile the engine's next 20 steps?"
        await pilot.press("enter")
        assert app.screen is screen and not starts(ctl) and app.steering.profile_run is None

        await pilot.press("s", "tab", "enter")     # move to "Start profile" and press
        await until(pilot, lambda: app.steering.profile_run is not None and app.steering.profile_run.id)
        assert starts(ctl) == [("profile_start", {"steps": 20})]
        app.refresh_view(force=True)
        summary = text_of(screen, "#prof-summary")
        assert "profile p1 running  0/20 steps" in summary
        assert "runs slower while profiling" in summary and "c cancels" in summary
        await pilot.press("s")                     # one at a time
        assert not isinstance(app.screen, ConfirmScreen)

        ctl.profile_hold = False
        await until(pilot, lambda: app.steering.profile_run.state == "done")

        def done_shown() -> bool:
            app.refresh_view(force=True)
            return "profile p1 done" in text_of(screen, "#prof-summary")

        await until(pilot, done_shown)
        summary = text_of(screen, "#prof-summary")
        assert "profile p1 done  20 steps (41–60) on cpu" in summary
        assert "(fake)" in summary                  # the engine's slowdown note
        text = text_of(screen, "#prof-text")
        assert "Step phases" in text and "execute 89.3%" in text
        assert "attention" in text and "mlp" in text
        assert "aten::mm" in text and "800.0 ms" in text
        width = screen.query_one("#prof-text").content_size.width
        assert all(len(line) <= width for line in text.splitlines()), (width, text)
        results = screen.query_one("#prof-results")
        if size == (80, 24):                       # more than fits: it scrolls (once laid out)
            await until(pilot, lambda: results.max_scroll_y > 0)
            await pilot.press("end")
            await until(pilot, lambda: results.scroll_y > 0)


async def test_cancel_stops_a_running_profile():
    ctl = FakeControl()
    ctl.profile_hold = True
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("P", "s", "tab", "enter")
        await until(pilot, lambda: app.steering.profile_run is not None and app.steering.profile_run.id)
        await pilot.press("c")
        await until(pilot, lambda: app.steering.profile_run.state == "cancelled")
        assert ("profile_cancel", {"profile": "p1"}) in ctl.calls
        app.refresh_view(force=True)
        assert "profile p1 cancelled after 0/20 steps" in text_of(app.screen, "#prof-summary")


async def test_an_engine_that_does_not_answer_is_reported():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches)
        ctl.down = True
        await pilot.press("P", "s", "tab", "enter")
        await until(pilot, lambda: app.steering.profile_run is not None and not app.steering.profile_run.active)
        app.refresh_view(force=True)
        summary = text_of(app.screen, "#prof-summary")
        assert "profile error" in summary and "no reply" in summary


async def test_the_palette_and_help_offer_profiling():
    app = replay_app(control=FakeControl())
    async with app.run_test(size=(80, 24)) as pilot:
        texts = [t for t, _c, _h in ConsoleCommands(app.screen)._commands()]
        assert PALETTE_ENTRY in texts
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = str(app.screen.query_one("#help-text").render())
        assert "profile the engine's next N steps" in help_text


async def test_readonly_has_no_profiling():
    ctl = FakeControl()
    app = replay_app(control=ctl, readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("P")
        assert not isinstance(app.screen, ProfileScreen)
        texts = [t for t, _c, _h in ConsoleCommands(app.screen)._commands()]
        assert PALETTE_ENTRY not in texts
        await pilot.press("question_mark")
        help_text = str(app.screen.query_one("#help-text").render())
        assert "read-only: profiling is disabled" in help_text
        await pilot.press("escape")
        app.action_show("profile")                 # even reached another way: no action
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ProfileScreen)
        assert "s" not in screen.active_bindings
        await pilot.press("s")
        assert not isinstance(app.screen, ConfirmScreen) and not starts(ctl)
        assert "profiling is disabled" in text_of(screen, "#prof-summary")
