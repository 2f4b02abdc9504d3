"""SVG snapshots of every screen from the recorded stream (pytest-textual-snapshot).

Stable by construction: the replay is ingested before the first frame and the console's clock
is the recording's, so no wall time reaches the screen; inputs do not blink. Update with
``pytest tests/console/test_console_snapshots.py --snapshot-update`` and look at the SVGs.
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from textual.widgets import Input

from support.console_testing import RECORDING, FakeControl, replay_app
from support.synthetic import generate
from support.synthetic_dp import showcase
from vconsole.telemetry.record import read_records

pytestmark = pytest.mark.slow

END = max(ts for ts, _ in read_records(RECORDING))


async def settle(pilot) -> None:
    """Wait for the control worker's config fetch (if any) and a fresh apply."""
    app = pilot.app
    deadline = time.monotonic() + 5
    while app.steering.control is not None and not app.steering.config_fetches and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for box in app.screen.query(Input):
        box.cursor_blink = False
    app.refresh_view(force=True)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_overview(snap_compare, size):
    assert snap_compare(replay_app(), terminal_size=size, run_before=settle)


def test_requests(snap_compare):
    assert snap_compare(replay_app(), press=["2"], terminal_size=(80, 24), run_before=settle)


def test_requests_filtered_and_sorted(snap_compare):
    assert snap_compare(replay_app(), press=["2", "slash", *"prio>0", "enter", "s", "s"],
                        terminal_size=(120, 40), run_before=settle)


def test_kv_map(snap_compare):
    assert snap_compare(replay_app(), press=["3"], terminal_size=(80, 24), run_before=settle)


def test_kv_map_zoomed_out(snap_compare):
    assert snap_compare(replay_app(), press=["3", "minus", "minus"], terminal_size=(120, 40),
                        run_before=settle)


def test_config(snap_compare):
    assert snap_compare(replay_app(control=FakeControl()), press=["4"],
                        terminal_size=(120, 40), run_before=settle)


def test_config_invalid_value(snap_compare):
    async def edit(pilot) -> None:
        await pilot.press("4")
        await settle(pilot)
        pilot.app.screen.focus_key("max_num_seqs")
        await pilot.press("e")
        box = pilot.app.screen.query_one("#cfg-input", Input)
        box.cursor_blink = False
        box.value = ""
        await pilot.press(*"many", "enter")
        await pilot.pause()

    assert snap_compare(replay_app(control=FakeControl()), terminal_size=(80, 24),
                        run_before=edit)


def test_confirmation(snap_compare):
    async def risky(pilot) -> None:
        await pilot.press("4")
        await settle(pilot)
        pilot.app.request_change("max_num_seqs", "2")
        await pilot.pause()

    assert snap_compare(replay_app(control=FakeControl()), terminal_size=(80, 24),
                        run_before=risky)


def test_readonly_config(snap_compare):
    assert snap_compare(replay_app(), press=["4"], terminal_size=(80, 24), run_before=settle)


def test_alerts(snap_compare):
    assert snap_compare(replay_app(), press=["exclamation_mark"], terminal_size=(80, 24),
                        run_before=settle)


def test_help(snap_compare):
    assert snap_compare(replay_app(), press=["question_mark"], terminal_size=(80, 24))


def test_engine_down(snap_compare):
    assert snap_compare(replay_app(clock=lambda: END + 12.5), terminal_size=(80, 24),
                        run_before=settle)


def test_terminal_too_small(snap_compare):
    assert snap_compare(replay_app(), terminal_size=(60, 16), run_before=settle)


def test_narrow_single_column(snap_compare):
    assert snap_compare(replay_app(), terminal_size=(70, 30), run_before=settle)


# The same screens from telemetry recorded off a real `vconsole engine` process (tiny model,
# demo load; tests/data/record_engine.py), so a change in the publisher's fields shows here.
ENGINE_RECORDING = RECORDING.with_name("engine.vrec")


@pytest.mark.parametrize("press", [[], ["2"], ["3"]], ids=["overview", "requests", "kv"])
def test_real_engine_recording(snap_compare, press):
    assert snap_compare(replay_app(ENGINE_RECORDING), press=press, terminal_size=(80, 24),
                        run_before=settle)


# Issue #10: the Trends screen and the Overview's latency panel, from the synthetic stream with
# its ``latency`` topic (the same 30 s as synthetic.vrec, plus latency); the recording itself has
# none, so the snapshots above show "no latency data".
@functools.cache
def latency_stream() -> tuple:
    return tuple(generate(duration_s=30.0))


def latency_app():
    return replay_app(records=latency_stream())


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_overview_latency_panel(snap_compare, size):
    assert snap_compare(latency_app(), terminal_size=size, run_before=settle)


# Issue #30: the synthetic stream's engine stores int8 KV blocks and says so (dtype, bytes per
# token, capacity): the Overview's KV panel border above, and the KV screen's legend here.
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_kv_map_names_how_the_pool_stores_tokens(snap_compare, size):
    assert snap_compare(latency_app(), press=["3"], terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_trends_last_minute(snap_compare, size):
    assert snap_compare(latency_app(), press=["5", "t", "t"], terminal_size=size,
                        run_before=settle)


def test_trends_latency_plots(snap_compare):
    assert snap_compare(latency_app(), press=["5", "t", "t", "v", "v"], terminal_size=(80, 24),
                        run_before=settle)


def test_trends_without_latency(snap_compare):
    assert snap_compare(replay_app(), press=["5", "v", "v"], terminal_size=(80, 24),
                        run_before=settle)


@pytest.mark.parametrize("ranks", [2, 8])
def test_ranks_screen_of_a_data_parallel_group(snap_compare, ranks):
    recs = list(showcase(ranks, 12.0, stop_rank=(ranks - 3, 0.5) if ranks > 2 else None))
    assert snap_compare(replay_app(records=recs), press=["6"], terminal_size=(80, 24),
                        run_before=settle)


def test_overview_of_a_data_parallel_group(snap_compare):
    recs = list(showcase(2, 12.0))
    assert snap_compare(replay_app(records=recs), terminal_size=(80, 24), run_before=settle)
