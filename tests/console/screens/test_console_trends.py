"""The Trends screen and the Overview's latency panel, driven by Pilot at 80x24 and 120x40.

Fed by the synthetic stream with its ``latency`` topic (what an engine sends now) and by
tests/data/synthetic.vrec, a recording without it (what an older engine sent).
"""

from __future__ import annotations

import pytest
from textual.widgets import Static

from support.console_testing import replay_app
from support.synthetic import generate
from vconsole.console import format as fmt
from vconsole.console.palette import ConsoleCommands
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.trends import PLOTS, RANGES_S, TrendsScreen
from vconsole.console.widgets.trend_plot import TrendPlot

pytestmark = pytest.mark.slow

SIZES = [(80, 24), (120, 40)]
LATENCY_TOPICS = {"ttft", "itl"}


@pytest.fixture(scope="module")
def stream():
    """90 s of telemetry with the latency topic: longer than the 1-minute range."""
    return list(generate(duration_s=90))


def text_of(widget) -> str:
    r = widget.render()
    return getattr(r, "plain", None) or str(r)


def plots(app) -> dict[str, TrendPlot]:
    return {p.spec.key: p for p in app.screen.query(TrendPlot)}


def shown(app) -> list[str]:
    return [p.spec.key for p in app.screen.visible_plots()]


async def open_trends(pilot) -> TrendsScreen:
    await pilot.press("5")
    await pilot.pause()
    screen = pilot.app.screen
    assert isinstance(screen, TrendsScreen)
    return screen


@pytest.mark.parametrize("size", SIZES)
async def test_trends_shows_every_plot_with_data(size, stream):
    app = replay_app(records=stream)
    async with app.run_test(size=size) as pilot:
        screen = await open_trends(pilot)
        seen: set[str] = set()
        for _ in range(screen.pages):
            for key in shown(app):
                plot = plots(app)[key]
                assert plot.display and plot.message is None
                assert all(n > 0 for n in plot.drawn.values()), (key, plot.drawn)
                assert plot.spec.title in text_of(plot)
                seen.add(key)
            await pilot.press("v")
            await pilot.pause()
        assert seen == {p.key for p in PLOTS}


async def test_at_80x24_two_plots_fit_and_v_pages_through_them(stream):
    app = replay_app(records=stream)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_trends(pilot)
        assert screen.pages == 3 and shown(app) == ["tokens", "step"]
        bar = text_of(screen.query_one("#trends-bar", Static))
        assert "plots 1/3" in bar
        await pilot.press("v")
        await pilot.pause()
        assert shown(app) == ["queues", "kv"]
        assert not plots(app)["tokens"].display
        await pilot.press("right", "right")              # wraps round to the first page
        await pilot.pause()
        assert shown(app) == ["tokens", "step"]
        await pilot.press("left")
        await pilot.pause()
        assert shown(app) == ["ttft", "itl"]
        assert "plots 3/3: TTFT, ITL" in text_of(screen.query_one("#trends-bar", Static))


async def test_at_120x40_all_plots_fit_and_paging_is_off(stream):
    app = replay_app(records=stream)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_trends(pilot)
        assert screen.pages == 1 and len(shown(app)) == len(PLOTS)
        assert screen.check_action("page", (1,)) is False
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert screen.pages == 3 and screen.check_action("page", (1,)) is True
        assert len(shown(app)) == 2


async def test_t_cycles_the_range_and_the_plots_follow(stream):
    app = replay_app(records=stream)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_trends(pilot)
        tokens = plots(app)["tokens"]
        assert screen.window_s == 300.0
        five_min = tokens.drawn["tokens/s"]
        assert five_min >= 90                              # the whole 90 s stream
        assert "-5m" in text_of(tokens) and "now" in text_of(tokens)
        await pilot.press("t")
        await pilot.pause()
        assert screen.window_s == 900.0 and "-15m" in text_of(tokens)
        assert tokens.drawn["tokens/s"] == five_min
        await pilot.press("t")
        await pilot.pause()
        assert screen.window_s == 60.0 and "-60s" in text_of(tokens)
        assert 59 <= tokens.drawn["tokens/s"] <= 61        # one point a second, last minute
        bar = text_of(screen.query_one("#trends-bar", Static))
        assert all(f"{r / 60:g} min" in bar for r in RANGES_S)


async def test_the_palette_switches_the_range():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        commands = {t: c for t, c, _h in ConsoleCommands(app.screen)._commands()}
        assert "Go to Trends" in commands
        commands["Trends: last 15 minutes"]()
        await pilot.pause()
        await pilot.pause()
        assert isinstance(app.screen, TrendsScreen) and app.screen.window_s == 900.0
        commands["Trends: next plots"]()
        await pilot.pause()
        await pilot.pause()
        assert app.screen.page == 1


async def test_a_recording_without_latency_says_so_instead_of_plotting():
    app = replay_app()                                  # synthetic.vrec: no latency topic
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_trends(pilot)
        assert plots(app)["tokens"].message is None
        await pilot.press("v", "v")
        await pilot.pause()
        assert set(shown(app)) == LATENCY_TOPICS
        for key in LATENCY_TOPICS:
            plot = plots(app)[key]
            assert plot.message == "no latency data" and "no latency data" in text_of(plot)
        assert screen.pages == 3
        await pilot.press("1")
        await pilot.pause()
        assert "no latency data" in text_of(app.screen.query_one("#latency"))


@pytest.mark.parametrize("size", SIZES)
async def test_latency_panel_shows_the_stream_numbers(size, stream):
    app = replay_app(records=stream)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        lat = app.state.engine().latest["latency"]
        window = lat["overall"]["window"]
        panel = app.screen.query_one("#latency")
        lines = text_of(panel).splitlines()
        for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("e2e", "e2e_s"),
                           ("queue", "queue_s")):
            line = next(ln for ln in lines if ln.startswith(label))
            assert fmt.ms(window[key]["p50"]) in line and fmt.ms(window[key]["p99"]) in line
        assert panel.border_title == (f"Latency p50/p99 · {lat['window_s']:g}s · "
                                      f"{window['e2e_s']['count']:,} req")
        # Readable: the panel is on screen, not scrolled away below the fold.
        assert panel.region.bottom <= size[1] - 1


async def test_help_lists_the_trends_keys():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = text_of(app.screen.query_one("#help-text", Static))
        assert "Trends" in text and "time range: last 1 / 5 / 15 minutes" in text
