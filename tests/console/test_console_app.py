"""The console app driven by Pilot: a recorded stream in, keys pressed, what is on screen out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from textual.widgets import Input, Static

from support.console_testing import (
    FakeControl,
    big_sched,
    foreign_version_frames,
    frames,
    replay_app,
    until,
)
from support.synthetic import generate
from vconsole.console.changes import APPLIED, INVALID, RESTART
from vconsole.console.pacer import RefreshPacer
from vconsole.console.palette import ConsoleCommands
from vconsole.console.requests_view import sort_rows
from vconsole.console.screens.config import ConfigScreen
from vconsole.console.screens.kvmap import KvScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.screens.requests import RequestsScreen
from vconsole.console.widgets.chrome import Banner, TabBar, TooSmall
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.console.widgets.kv_grid import KvGrid
from vconsole.console.widgets.request_table import RequestTable
from vconsole.telemetry.record import read_records
from vconsole.telemetry.schema import RequestColumns

# Each test runs the whole Textual app under Pilot (0.2-2 s each, ~25 s for the module): the
# fast layer (make test-fast) leaves them to make test, like the snapshots.
pytestmark = pytest.mark.slow

SIZES = [(80, 24), (120, 40)]


def kv_map_app(states, *, num_free: int, num_used: int):
    """A replayed engine whose one ``kv`` message carries ``states`` as its block map."""
    body = {"num_blocks": len(states), "block_size": 16, "num_free": num_free,
            "num_used": num_used, "num_cached": 0, "num_shared": 0, "usage": 0.3,
            "token_usage": 0.3, "fragmentation": 0.0, "prefix_queries": 0, "prefix_hits": 0,
            "prefix_hit_rate": 0.0, "block_states": states}
    t0 = 1_700_000_000.0
    return replay_app(records=[(t0, frames("kv", body, ts=t0))])


def text_of(widget: Static) -> str:
    return str(widget.render())


def last_ts(path=None) -> float:
    from support.console_testing import RECORDING
    return max(ts for ts, _ in read_records(path or RECORDING))


@pytest.mark.parametrize("size", SIZES)
async def test_digits_switch_screens(size):
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        assert isinstance(app.screen, OverviewScreen)
        for key, cls in (("2", RequestsScreen), ("3", KvScreen), ("4", ConfigScreen),
                         ("1", OverviewScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, cls)
            assert cls.MODE in app.current_mode


@pytest.mark.parametrize("size", SIZES)
async def test_overview_numbers_match_the_payloads(size):
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        eng = app.state.engine()
        sc, kv, st = eng.latest["sched"], eng.latest["kv"], eng.latest["step"]
        queues = text_of(app.screen.query_one("#queues"))
        assert f"{sc['num_running']}/{sc['max_num_seqs']}" in queues
        assert f"waiting {sc['num_waiting']:>14}"[:10] in queues
        assert str(sc["num_waiting"]) in queues.splitlines()[0]
        kvt = text_of(app.screen.query_one("#kv"))
        assert f"{kv['usage'] * 100:.1f}%" in kvt
        assert f"{kv['num_used']}/{kv['num_blocks']:,}" in kvt
        summary = text_of(app.screen.query_one("#summary"))
        assert f"{st['steps_per_s']:.1f} steps/s" in summary
        assert f"{st['tokens_per_s']:,.0f} tok/s" in summary
        gpu = text_of(app.screen.query_one("#gpu"))
        assert "H200" in gpu and "util" in gpu
        alerts = text_of(app.screen.query_one("#alerts"))
        assert "waiting" in alerts and "warning" in alerts


async def test_gpu_panel_explains_why_there_is_no_gpu():
    app = replay_app(records=list(generate(duration_s=2, gpu=False)))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "no NVIDIA GPU: NVML library" in text_of(app.screen.query_one("#gpu"))


async def test_requests_filter_and_sort():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        table = screen.query_one(RequestTable)
        sc = app.state.engine().latest["sched"]
        assert len(table.rows) == len(sc["requests"])
        ages = [r["age_s"] for r in table.rows]
        assert ages == sorted(ages, reverse=True)          # default: oldest first
        await pilot.press("slash", *"state:running", "enter")
        assert screen.filter_text == "state:running"
        assert {r["state"] for r in table.rows} == {"running"}
        assert len(table.rows) == sc["num_running"]
        assert f"{sc['num_running']} of" in text_of(screen.query_one("#req-summary"))
        await pilot.press("s")                              # age -> id, ascending
        ids = [r["id"] for r in table.rows]
        assert screen.sort_key == "id" and ids == sorted(ids)
        await pilot.press("r")
        assert [r["id"] for r in table.rows] == sorted(ids, reverse=True)
        await pilot.press("escape")
        assert screen.filter_text == "" and len(table.rows) == len(sc["requests"])


async def test_request_cursor_follows_its_request_when_rows_move():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2", "down", "down")
        table = app.screen.query_one(RequestTable)
        picked = table.cursor_id
        await pilot.press("r")                              # reverse: the row moves
        assert table.cursor_id == picked
        assert table.rows[table.cursor]["id"] == picked


async def test_kv_map_zoom():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        grid = app.screen.query_one(KvGrid)
        fit = grid.blocks_per_cell
        assert grid.zoom is None and fit == 1               # 1024 blocks fit at 80x24
        assert "1 cell = 1 block (fit)" in text_of(app.screen.query_one("#kv-zoom"))
        await pilot.press("minus", "minus")
        assert grid.blocks_per_cell == 4
        assert grid.rows == -(-1024 // 4 // grid.columns)
        assert "1 cell = 4 blocks (zoomed out)" in text_of(app.screen.query_one("#kv-zoom"))
        await pilot.press("plus")
        assert grid.blocks_per_cell == 2
        await pilot.press("0", "plus")                     # below one block per cell: wider
        assert grid.blocks_per_cell == 1 and grid.cell_width == 2
        assert grid.rows > grid.scrollable_content_region.height   # now it scrolls
        assert "×2 wide (zoomed in)" in text_of(app.screen.query_one("#kv-zoom"))
        await pilot.press("0")
        assert grid.zoom is None and grid.blocks_per_cell == fit


async def test_kv_map_gives_a_small_pool_wider_cells():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        grid = app.screen.query_one(KvGrid)
        assert grid.blocks_per_cell == 1 and grid.cell_width == 2
        assert grid.rows <= grid.scrollable_content_region.height


async def test_kv_map_summarises_a_pool_larger_than_the_screen():
    import numpy as np
    states = np.zeros(200_000, dtype=np.uint8)
    states[::3] = 1
    states[100_000:] = 2
    app = kv_map_app(states, num_free=0, num_used=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        grid = app.screen.query_one(KvGrid)
        assert grid.blocks_per_cell > 1
        assert grid.rows <= grid.scrollable_content_region.height
        zoom = text_of(app.screen.query_one("#kv-zoom"))
        assert f"1 cell = {grid.blocks_per_cell:,} blocks (fit)" in zoom and "shade" in zoom


async def open_editor(pilot, app, key: str) -> ConfigScreen:
    await pilot.press("4")
    await until(pilot, lambda: app.state.config is not None and app.steering.config_fetches)
    screen = app.screen
    assert isinstance(screen, ConfigScreen)
    await pilot.pause()
    assert screen.focus_key(key)
    await pilot.press("e")
    assert screen.editing == key
    return screen


async def type_value(pilot, screen, text: str) -> None:
    box = screen.query_one("#cfg-input", Input)
    box.value = ""
    await pilot.press(*text, "enter")


async def test_config_edit_rejects_a_bad_value_with_the_reason():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_editor(pilot, app, "max_num_seqs")
        await type_value(pilot, screen, "lots")
        error = text_of(screen.query_one("#cfg-error"))
        assert "expected an integer" in error
        assert app.steering.replies["max_num_seqs"].status == INVALID
        assert screen.editing == "max_num_seqs"             # still editing
        assert [c for c in ctl.calls if c[0] == "set_config"] == []
        await pilot.press("escape")
        assert screen.editing is None


async def test_config_change_reaches_the_engine_and_its_ack_is_shown():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_editor(pilot, app, "max_num_seqs")
        await type_value(pilot, screen, "48")
        await until(pilot, lambda: app.steering.replies["max_num_seqs"].done)
        rec = app.steering.replies["max_num_seqs"]
        assert rec.status == APPLIED and rec.version == 2
        assert ctl.config.max_num_seqs == 48
        assert app.state.config.values["max_num_seqs"] == 48
        assert app.steering.change_log == [rec]
        await pilot.pause()
        assert "applied (v2)" in text_of(screen.query_one("#cfg-history"))
        row = screen.table.get_row("max_num_seqs")
        assert str(row[1]) == "48" and "applied" in str(row[3])


async def test_restart_only_key_is_answered_restart_required():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_editor(pilot, app, "block_size")
        await type_value(pilot, screen, "32")
        await until(pilot, lambda: app.steering.replies["block_size"].done)
        assert app.steering.replies["block_size"].status == RESTART
        assert ctl.config.block_size == 16


async def test_engine_rejection_reason_is_shown():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_editor(pilot, app, "alert_waiting_warning")
        await type_value(pilot, screen, "500")   # above the critical threshold (100)
        await until(pilot, lambda: app.steering.replies["alert_waiting_warning"].done)
        rec = app.steering.replies["alert_waiting_warning"]
        assert rec.status == "rejected" and "exceeds critical" in rec.reason
        assert "exceeds critical" in text_of(screen.query_one("#cfg-error"))


async def test_big_cut_of_max_num_seqs_asks_for_confirmation():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_editor(pilot, app, "max_num_seqs")
        await type_value(pilot, screen, "4")
        assert isinstance(app.screen, ConfirmScreen)
        assert "preempted" in app.screen.consequence
        await pilot.press("y", "enter")                    # no bare y; enter is on Cancel
        assert not isinstance(app.screen, ConfirmScreen)
        assert [c for c in ctl.calls if c[0] == "set_config"] == []
        await pilot.press("e")
        await type_value(pilot, screen, "4")
        await pilot.press("tab", "enter")                  # move to "Apply change" and press
        await until(pilot, lambda: app.steering.replies["max_num_seqs"].done)
        assert ctl.config.max_num_seqs == 4


async def test_control_timeout_is_reported_not_raised():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_editor(pilot, app, "policy")
        ctl.down = True
        await type_value(pilot, screen, "hybrid")
        await until(pilot, lambda: app.steering.replies["policy"].done)
        assert app.steering.replies["policy"].status == "no answer"


async def test_readonly_hides_every_action():
    app = replay_app(control=FakeControl(), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        await pilot.pause()
        screen = app.screen
        assert "e" not in screen.active_bindings
        await pilot.press("e")
        assert screen.editing is None
        assert app.request_change("max_num_seqs", "8") is not None
        texts = [t for t, _c, _h in ConsoleCommands(screen)._commands()]
        assert not [t for t in texts if t.startswith("Edit config")]
        assert "read-only" in text_of(screen.query_one("#cfg-summary"))


async def test_a_console_without_control_is_readonly():
    app = replay_app()
    assert app.readonly


async def test_palette_has_an_entry_for_every_action():
    app = replay_app(control=FakeControl())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state.config is not None and app.steering.config_fetches)
        texts = [t for t, _c, _h in ConsoleCommands(app.screen)._commands()]
        for want in ("Go to Overview", "Go to Requests", "Go to KV map", "Go to Config",
                     "Pause updates", "Start recording the telemetry stream", "Filter requests",
                     "Sort requests by age", "KV map: zoom in", "KV map: zoom out",
                     "Edit config: max_num_seqs", "Help: keys and legend", "Quit"):
            assert want in texts


async def test_too_small_terminal_says_what_it_needs():
    app = replay_app()
    async with app.run_test(size=(60, 16)) as pilot:
        await pilot.pause()
        box = app.screen.query_one(TooSmall)
        assert box.display and "need 64×18, have 60×16" in text_of(box)
        assert not app.screen.query_one("#body").display
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert not box.display and app.screen.query_one("#body").display


async def test_schema_mismatch_is_a_clear_message():
    recs = list(generate(duration_s=1))
    recs.append((recs[-1][0] + 0.1, foreign_version_frames()))
    app = replay_app(records=recs)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        banner = app.screen.query_one(Banner)
        assert banner.display
        assert "SCHEMA MISMATCH" in text_of(banner) and "version 99" in text_of(banner)


async def test_stale_heartbeat_is_shown_as_down():
    end = last_ts()
    app = replay_app(clock=lambda: end + 10)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        banner = text_of(app.screen.query_one(Banner))
        assert "ENGINE DOWN" in banner and "no heartbeat for 10." in banner
        assert "● down" in text_of(app.screen.query_one(TabBar))


async def test_engine_down_then_back_refetches_config():
    """Live-like: the clock runs past the heartbeat, then a heartbeat arrives again."""
    recs = list(generate(duration_s=2))
    end = recs[-1][0]
    now = [end]
    ctl = FakeControl()
    app = replay_app(records=recs, control=ctl, clock=lambda: now[0])
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches == 1)
        now[0] = end + 10
        await until(pilot, lambda: app.state.engine().was_down)
        assert app.state.engine().status(now[0]) == "down"
        app.state.ingest(frames("health", {"state": "running", "uptime_s": 1.0, "steps": 0,
                                           "interval_s": 1.0}, seq=999), now[0])
        await until(pilot, lambda: app.steering.config_fetches == 2)
        await until(pilot, lambda: "ENGINE DOWN" not in text_of(app.screen.query_one(Banner)))


async def test_pause_freezes_the_request_table():
    recs = list(generate(duration_s=2))
    end = recs[-1][0]
    app = replay_app(records=recs)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2", "p")
        table = app.screen.query_one(RequestTable)
        before = list(table.rows)
        rows = [{"id": "new-1", "state": "running", "priority": 0, "num_prompt_tokens": 1,
                 "num_output_tokens": 1, "num_blocks": 1, "age_s": 0.1}]
        sched = {"num_waiting": 0, "num_running": 1, "num_preempted": 0,
                 "num_preemptions_total": 0, "num_finished_total": 0, "max_num_seqs": 8,
                 "max_num_batched_tokens": 64, "policy": "fcfs", "requests": rows,
                 "requests_truncated": False}
        app.state.ingest(frames("sched", sched, seq=10_000, ts=end), end)
        app.refresh_view(force=True)
        assert table.rows == before
        assert "PAUSED" in text_of(app.screen.query_one(TabBar))
        await pilot.press("p")
        assert [r["id"] for r in table.rows] == ["new-1"]



async def test_ten_thousand_requests_stay_responsive(monkeypatch):
    """A new 10k-row snapshot is shown in one apply, in sort order, building only the lines on
    screen; the cursor stays on its request through new data and a re-sort. (How long that
    takes is `vconsole bench console`'s ``sort_filter_ms`` and lag, not a test.)"""
    t0 = 1_700_000_000.0
    app = replay_app(records=[(t0, frames("sched", big_sched(10_000), ts=t0))])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        assert len(table.rows) == 10_000
        first = table.cursor_id
        built: list[int] = []
        row = RequestColumns.row
        monkeypatch.setattr(RequestColumns, "row",
                            lambda self, i: (built.append(i), row(self, i))[1])
        newer = big_sched(10_000, snapshot_ts=t0 + 0.1)
        newer["requests"] = newer["requests"][::-1]          # same rows, arriving reversed
        app.state.ingest(frames("sched", newer, seq=1, ts=t0 + 0.1), t0 + 0.1)
        app.refresh_view(force=True)
        await pilot.pause()
        height = table.scrollable_content_region.height
        assert 0 < len(set(built)) <= height               # only the visible lines were built
        want = [r["id"] for r in sort_rows(newer["requests"], "age_s", reverse=True)]
        assert [table.rows.id_at(i) for i in range(len(table.rows))] == want
        assert table.cursor_id == first and table.rows.id_at(table.cursor) == first
        await pilot.press("pagedown", "pagedown", "end")
        assert table.cursor == len(table.rows) - 1
        picked = table.cursor_id
        await pilot.press("s")                              # re-sort 10k rows: by id
        assert app.screen.sort_key == "id"
        assert table.rows[table.cursor]["id"] == picked
        top = round(table.scroll_y)
        assert top <= table.cursor < top + height           # and it is on screen
        assert [table.rows.id_at(i) for i in range(5)] == sorted(want)[:5]


async def test_a_snapshot_is_shown_when_it_arrives_and_a_burst_beyond_the_budget_waits():
    """The reader's wake-up applies a snapshot at once (the timer alone would wait
    AGE_TICK_S) while the refresh budget allows — refresh_hz a second, two saved up; one
    arriving when the budget is spent is held until a token is there, then shown."""
    recs = list(generate(duration_s=1))
    end = recs[-1][0]
    app = replay_app(records=recs)                  # 10 Hz: a period of 0.1 s
    # The pacer's clock stands still: its budget is spent by arrivals only (a loaded machine
    # that is slow between two arrivals cannot refill it), and its age tick never comes due
    # after the first refresh, so only a wake-up can show a snapshot.
    app.pacer = RefreshPacer(app.pacer.rate_hz, clock=lambda: 1000.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)

        def arrive(rid: str, seq: int) -> None:
            rows = [{"id": rid, "state": "running", "priority": 0, "num_prompt_tokens": 1,
                     "num_output_tokens": 1, "num_blocks": 1, "age_s": 0.1}]
            body = {**big_sched(0), "requests": rows, "snapshot_ts": float(seq)}
            app.state.ingest(frames("sched", body, seq=seq, ts=end), end)
            app.sources[0].on_data()                     # what the reader thread calls

        app.refresh_view(force=True)
        await pilot.pause(0.15)                     # a period on, well before the timer's
        before = app.refreshes
        await asyncio.to_thread(arrive, "first", 50_001)
        await pilot.pause()
        assert app.refreshes == before + 1 and [r["id"] for r in table.rows] == ["first"]
        seq = 50_001
        while app._wake_timer is None and seq < 50_010:   # the burst of two, then held
            seq += 1
            await asyncio.to_thread(arrive, f"r{seq}", seq)
            await pilot.pause()
        assert app._wake_timer is not None           # the budget ran out: this one is held
        assert [r["id"] for r in table.rows] != [f"r{seq}"]
        await until(pilot, lambda: [r["id"] for r in table.rows] == [f"r{seq}"])
        assert app._wake_timer is None


async def test_reader_wake_ups_refresh_at_a_bounded_rate_and_show_the_last_data():
    """The reader wakes the app after every batch; however often, the screen refreshes at
    most refresh_hz times a second plus the saved-up burst of two, and the newest snapshot is
    on screen once the stream pauses."""
    recs = list(generate(duration_s=1))
    end = recs[-1][0]
    app = replay_app(records=recs, refresh_hz=5.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        stop = threading.Event()
        sent: list[int] = []

        def reader() -> None:
            seq = 10_000
            while not stop.is_set():
                seq += 1
                rows = [{"id": f"burst-{seq}", "state": "running", "priority": 0,
                         "num_prompt_tokens": 1, "num_output_tokens": 1, "num_blocks": 1,
                         "age_s": 0.1}]
                body = {**big_sched(0), "requests": rows, "snapshot_ts": float(seq)}
                app.state.ingest(frames("sched", body, seq=seq, ts=end), end)
                app.sources[0].on_data()                     # what the reader thread calls
                sent.append(seq)
                time.sleep(0.002)

        th = threading.Thread(target=reader, daemon=True)
        before = app.refreshes
        th.start()
        await pilot.pause(1.0)
        stop.set()
        th.join()
        assert len(sent) > 100 and app.refreshes - before <= 5 + 2 + 1
        await until(pilot, lambda: [r["id"] for r in table.rows] == [f"burst-{sent[-1]}"])


async def test_refresh_rate_is_bounded_whatever_the_message_rate():
    recs = list(generate(duration_s=1))
    app = replay_app(records=recs)
    async with app.run_test(size=(80, 24)) as pilot:
        stop = threading.Event()

        def flood() -> None:
            seq = 10_000
            while not stop.is_set():
                for _ in range(200):
                    seq += 1
                    app.state.ingest(frames("health", {"state": "running", "uptime_s": 1.0,
                                                       "steps": seq, "interval_s": 1.0},
                                            seq=seq), recs[-1][0])
                time.sleep(0.01)

        th = threading.Thread(target=flood, daemon=True)
        before, msgs = app.refreshes, app.state.messages
        th.start()
        await pilot.pause(1.0)
        stop.set()
        th.join()
        assert app.state.messages - msgs > 1000
        assert app.refreshes - before <= 13


async def test_a_payload_that_cannot_be_shown_is_reported_not_fatal():
    t0 = 1_700_000_000.0
    bad = {"steps": 3, "window_s": 0.1, "phase_s": "not a map", "step_time_p50_s": 0.01,
           "step_time_max_s": 0.02, "num_prefill_tokens": 0, "num_decode_tokens": 3,
           "tokens_per_s": 30.0, "steps_per_s": 30.0, "sched_share": 0.1}
    app = replay_app(records=[(t0, frames("step", bad, ts=t0))])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "cannot show this data" in text_of(app.screen.query_one(Banner))
        await pilot.press("2")
        assert isinstance(app.screen, RequestsScreen)


async def test_several_engines_are_kept_apart_and_n_cycles_them():
    recs = sorted([*generate(duration_s=2, seed=1),
                   *generate(duration_s=2, seed=2, engine="tiny-1", rank=1,
                             max_num_seqs=8)], key=lambda r: r[0])
    app = replay_app(records=recs)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert [e.key for e in app.state.engine_list()] == ["tiny-0/0", "tiny-1/1"]
        assert "/32" in text_of(app.screen.query_one("#queues"))
        await pilot.press("n")
        assert app.selected_engine == "tiny-1/1"
        assert "(2/2)" in text_of(app.screen.query_one(TabBar))
        assert "/8" in text_of(app.screen.query_one("#queues"))


def test_replay_of_a_file_that_is_not_a_recording_exits_2(tmp_path, capsys):
    import argparse

    from vconsole.commands.attach import main_replay
    bad = tmp_path / "x.vrec"
    bad.write_bytes(b"not a recording")
    assert main_replay(argparse.Namespace(file=str(bad), speed=1.0)) == 2
    assert "not a vconsole telemetry recording" in capsys.readouterr().err


async def test_r_records_into_the_cache_folder_not_the_working_directory(tmp_path, monkeypatch):
    from vconsole.console.app import VConsoleApp

    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    app = VConsoleApp(telemetry_endpoints=[f"ipc://{tmp_path}/no-engine"])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("R")
        await pilot.pause()
        assert app.sources[0].recording
        path = app.sources[0].recording_path
        await pilot.press("R")
        await pilot.pause()
    assert str(path).startswith(str(tmp_path / "cache" / "recordings"))
    assert (tmp_path / "cache" / "recordings").is_dir()
    assert not list(tmp_path.glob("*.vrec")), "nothing written into the working directory"


async def test_a_replay_shows_where_it_is_and_when_it_has_ended():
    app = replay_app()                       # played at once: already at its end
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        bar = text_of(app.screen.query_one(TabBar))
        assert "■ END " in bar and ".vrec" in bar


async def test_a_value_the_console_refuses_reads_not_sent_not_as_the_engines_reply():
    """Issue 27 item 9: 0 for max_num_seqs is stopped by the console's own check, so the
    "engine reply" column must not show it as the engine's answer."""
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_editor(pilot, app, "max_num_seqs")
        await type_value(pilot, screen, "0")
        await pilot.press("escape")
        await pilot.pause()
        reply = str(screen.table.get_row("max_num_seqs")[3])
        assert reply.startswith("not sent: invalid:") and ">= 1" in reply
        assert reply in text_of(screen.query_one("#cfg-detail"))   # whole, below the table
        assert "no changes sent yet" in text_of(screen.query_one("#cfg-history"))
        assert [c for c in ctl.calls if c[0] == "set_config"] == []
        await open_editor(pilot, app, "max_num_seqs")
        current = str(app.state.config.values["max_num_seqs"])
        await type_value(pilot, screen, current)             # the value in force: not sent either
        await pilot.pause()
        assert str(screen.table.get_row("max_num_seqs")[3]) == \
            "not sent: same as the current value"


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_six_on_a_lone_engine_says_why_there_is_no_ranks_screen():
    """Issue 27 item 13: ``6`` (Ranks) used to do nothing at all on one engine."""
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        await pilot.pause()
        assert isinstance(app.screen, OverviewScreen)
        assert any("data-parallel" in m and "one engine" in m for m in notices(app))
        await pilot.press("question_mark")
        await pilot.pause()
        help_text = str(app.screen.query_one("#help-text").render())
        assert "6" in help_text and "only while one is watched" in help_text


async def test_zoom_in_at_the_largest_cells_says_why_nothing_changes():
    """Issue 27 item 13: ``+`` on a small pool at fit size (already 4-wide cells) did nothing."""
    import numpy as np
    states = np.zeros(64, dtype=np.uint8)
    states[:20] = 1
    app = kv_map_app(states, num_free=44, num_used=20)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        grid = app.screen.query_one(KvGrid)
        assert grid.cell_width == 4
        await pilot.press("plus")
        await pilot.pause()
        assert grid.cell_width == 4
        assert any("zoomed in as far as it goes" in m and "4 characters wide" in m
                   for m in notices(app))
        await pilot.press("minus")
        assert grid.cell_width == 2                       # the other way still works


async def test_a_filter_word_that_is_not_a_comparison_is_named_not_searched():
    """Issue 27 item 13: ``prio>>x`` was silently a word search (and matched nothing)."""
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        await until(pilot, lambda: screen.total_rows > 0)
        await pilot.press("slash", *"prio>>x", "enter")
        await pilot.pause()
        summary = text_of(screen.query_one("#req-summary"))
        assert "not understood, ignored: prio>>x" in summary
        assert len(screen.table.rows) == screen.total_rows


async def test_the_step_panel_names_its_token_window_not_a_batch():
    """Issue 27 item 10: ``batch 0p+79d`` beside ``running 2/4`` was the token total of the
    telemetry window, not one step's batch: it is now named by its window."""
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:     # 80x24 drops it when too long
        await pilot.pause()
        st = app.state.engine().latest["step"]
        span = f"{st['window_s']:.1f}".removesuffix(".0")
        text = text_of(app.screen.query_one("#phases"))
        assert f"tokens/{span}s {st['num_prefill_tokens']:,}p+{st['num_decode_tokens']:,}d" \
            in text
        assert "batch" not in text
