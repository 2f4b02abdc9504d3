"""The Requests screen's detail pane at 80x24: ``enter`` on a row shows its figures, prompt head
and output tail (made terminal-safe), follows the cursor, keeps a finished request's last text,
``esc`` closes it; without published text it says how to turn it on."""

from __future__ import annotations

from typing import Any

from textual.widgets import Input, Static

from support.console_testing import FakeControl, frames, replay_app, until
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.console.widgets.request_detail import RequestDetail
from vconsole.console.widgets.request_table import RequestTable

T0 = 1_700_000_000.0
NOISE = "\x1b[2J\x00ok\x07"     # what a random-weight model emits: a screen clear, NUL, BEL


def sched(rows: list[dict[str, Any]], text: dict[str, list[str]] | None,
          ts: float = T0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "num_waiting": 1, "num_running": len(rows) - 1, "num_preempted": 0,
        "num_preemptions_total": 0, "num_finished_total": 0, "max_num_seqs": 8,
        "max_num_batched_tokens": 512, "policy": "fcfs", "requests": rows,
        "requests_truncated": False, "snapshot_ts": ts}
    if text is not None:
        body["request_text"] = text
    return body


def row(rid: str, state: str = "running", output: int = 5, age: float = 3.0) -> dict[str, Any]:
    return {"id": rid, "state": state, "priority": 1, "num_prompt_tokens": 42,
            "num_output_tokens": output, "num_blocks": 3, "age_s": age}


ROWS = [row("1:capital", age=9.0), row("1:noise", age=5.0), row("2:queued", "waiting", 0, 1.0)]
TEXT = {"1:capital": ["What is the capital of France?", "The capital of France is Paris."],
        "1:noise": ["count to ten" + "\n" + "please", NOISE]}


def pane_text(app: Any) -> str:
    return "\n".join(str(app.screen.query_one(f"#detail-{n}", Static).render())
                     for n in ("figures", "prompt", "output"))


async def test_enter_shows_the_rows_text_and_figures_and_esc_closes_it():
    app = replay_app(records=[(T0, frames("sched", sched(ROWS, TEXT)))])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        table, pane = app.screen.query_one(RequestTable), app.screen.query_one(RequestDetail)
        await until(pilot, lambda: len(table.rows) == 3)
        assert not pane.display
        await pilot.press("enter")                   # oldest first: 1:capital, 1:noise, ...
        await until(pilot, lambda: "Paris" in pane_text(app))
        assert "What is the capital of France?" in pane_text(app)
        await pilot.press("down")                    # the pane follows the cursor
        await until(pilot, lambda: "noise" in pane_text(app))
        shown = pane_text(app)
        assert pane.display and "1:noise" in shown and "running" in shown
        assert "prio 1" in shown and "42 tok" in shown and "5 tok" in shown and "5.0s" in shown
        assert "count to ten↵ please" in shown
        assert "\\x1b[2J\\x00ok\\x07" in shown and "\x1b" not in shown and "\x00" not in shown
        # The whole pane and a few table rows fit at 80x24.
        assert pane.region.bottom <= 23 and table.region.height >= 3
        assert pane.query_one("#detail-output").region.bottom <= pane.region.bottom
        await pilot.press("escape")
        assert not pane.display and app.screen.detail_id is None


async def test_a_finished_request_keeps_its_last_text_in_the_pane():
    later = sched([r for r in ROWS if r["id"] != "1:capital"],
                  {k: v for k, v in TEXT.items() if k != "1:capital"}, ts=T0 + 1)
    app = replay_app(records=[(T0, frames("sched", sched(ROWS, TEXT)))])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        await until(pilot, lambda: len(table.rows) == 3)
        await pilot.press("enter")
        await until(pilot, lambda: "Paris" in pane_text(app))
        app.state.ingest(frames("sched", later, seq=1, ts=T0 + 1), T0 + 1)
        app.refresh_view(force=True)
        await until(pilot, lambda: len(table.rows) == 2)
        shown = pane_text(app)
        assert "1:capital" in shown and "gone" in shown and "Paris" in shown


async def test_without_published_text_the_pane_says_how_to_turn_it_on():
    app = replay_app(records=[(T0, frames("sched", sched(ROWS, None)))])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: len(app.screen.query_one(RequestTable).rows) == 3)
        await pilot.press("enter")
        await until(pilot, lambda: "not published" in pane_text(app))
        shown = " ".join(pane_text(app).split())
        assert "--set publish_request_text=true" in shown and "1:capital" in shown
        await pilot.press("escape")
        assert not app.screen.query_one(RequestDetail).display


async def test_turning_text_on_from_the_config_screen_asks_first_spelling_out_what_it_sends():
    ctl = FakeControl()
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: app.state.config is not None and app.steering.config_fetches)
        screen = app.screen
        await pilot.pause()
        assert screen.focus_key("publish_request_text")
        await pilot.press("e")
        screen.query_one("#cfg-input", Input).value = ""
        await pilot.press(*"true", "enter")
        assert isinstance(app.screen, ConfirmScreen)
        assert "prompt head and output tail" in app.screen.consequence
        await pilot.press("tab", "enter")                  # "Apply change"
        await until(pilot, lambda: app.steering.replies["publish_request_text"].done)
        assert ctl.config.publish_request_text is True
