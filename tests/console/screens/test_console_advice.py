"""The Advice screen driven by Pilot: a generated stream in, the advisor's suggestions listed with
their evidence, a hot one applied through the confirmation to the (fake) engine, and the outcome
in the Alerts panel."""

from __future__ import annotations

from typing import Any

import pytest
from textual.widgets import Static

from support.console_testing import FakeControl, frames, replay_app, until
from support.synthetic import generate
from vconsole.console.palette import ConsoleCommands
from vconsole.console.screens.advice import AdviceScreen
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.widgets.chrome import TabBar
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.shared.config import ConfigUpdate, EngineConfig, describe_config
from vconsole.wire.control import config_reply

pytestmark = pytest.mark.slow

# The scheduler is slow all along (the write-up's case); the engine's config is FakeControl's.
SLOW = {"duration_s": 20, "slow_window": (0, 2), "burst_window": (0, 0), "rate": 14}
FRAGMENTED = {"duration_s": 20, "slow_window": (0, 0), "burst_window": (0, 0),
              "block_size": 128, "prompt_range": (8, 40), "output_range": (4, 20)}


def text_of(widget: Static) -> str:
    return str(widget.render())


def sets(ctl: FakeControl) -> list[dict[str, Any]]:
    return [values for op, values in ctl.calls if op == "set_config"]


async def open_advice(pilot, app) -> AdviceScreen:
    if app.steering.control is not None:
        await until(pilot, lambda: app.steering.config_fetches)
    await pilot.press("a")
    await pilot.pause()
    assert isinstance(app.screen, AdviceScreen)
    app.refresh_view(force=True)
    await pilot.pause()
    return app.screen


async def test_the_advice_screen_lists_a_replayed_streams_advice_with_its_evidence():
    app = replay_app(records=list(generate(**SLOW)))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_advice(pilot, app)
        (a,) = screen.advice
        assert a.rule == "sched_share" and a.hot
        assert screen.table.row_count == 1
        def cell(key: str) -> str:
            return str(screen.table.get_cell(a.id, key))
        assert cell("rule") == "Scheduler overhead" and "policy fcfs → hybrid" in cell("change")
        assert cell("mode") == "hot"
        assert "1 suggestion" in text_of(screen.query_one("#adv-summary"))
        detail = text_of(screen.query_one("#adv-detail"))
        assert "of step time" in detail and "held in" in detail and "sched_share" in detail
        assert "a Advice" in text_of(screen.query_one(TabBar))
        # 80x24: the list, the reasons and the footer all fit
        box = screen.query_one("#adv-detail")
        assert box.region.height >= 4 and box.region.bottom <= 23
        await pilot.press("1")
        assert isinstance(app.screen, OverviewScreen)
        await pilot.pause()
        assert "advice: Scheduler overhead" in str(app.screen.query_one("#alerts").border_subtitle)


async def test_applying_a_hot_suggestion_is_confirmed_then_reaches_the_engine():
    ctl = FakeControl()            # max_num_seqs 32, fcfs: what the stream announces
    app = replay_app(records=list(generate(**SLOW)), control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_advice(pilot, app)
        (a,) = screen.advice
        assert [b for b in screen.active_bindings.values() if b.binding.action == "apply"]
        await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen)
        assert "max_num_seqs 32 →" in app.screen.title_text
        await pilot.press("enter")                        # focus starts on Cancel
        assert not isinstance(app.screen, ConfirmScreen) and sets(ctl) == []
        await pilot.press("A")                            # the footer's key; enter works too
        await pilot.press("tab", "enter")                 # "Apply advice"
        await until(pilot, lambda: app.steering.advice_outcomes and app.steering.advice_outcomes[-1].done)
        assert sets(ctl) == [a.change]                    # one all-or-nothing set_config
        assert ctl.config.policy == "hybrid"
        assert ctl.config.max_num_seqs == a.change["max_num_seqs"]
        assert app.steering.advice_outcomes[-1].ok
        assert app.state.config.values["policy"] == "hybrid"
        await pilot.pause()
        assert "applied" in text_of(screen.query_one("#adv-history"))
        assert screen.advice == []          # the evidence was gathered under the old config
        assert "gathering evidence" in text_of(screen.query_one("#adv-summary"))
        await pilot.press("1")
        await pilot.pause()
        alerts = text_of(app.screen.query_one("#alerts"))
        assert "advice sched_share" in alerts and "applied (v2)" in alerts


class NarrowerEngine(FakeControl):
    """An engine whose own table refuses max_num_seqs below 28 (say, another version)."""

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        low = values.get("max_num_seqs")
        if isinstance(low, int) and low < 28:
            self.calls.append(("set_config", dict(values)))
            update = ConfigUpdate(self.config, rejected={"max_num_seqs":
                                                         f"must be >= 28; got {low}"})
            return config_reply(self.version, self.config.to_dict(), update)
        return super().set_config(values)


async def test_a_rejected_suggestion_shows_the_engines_reason_in_alerts():
    ctl = NarrowerEngine()
    app = replay_app(records=list(generate(**SLOW)), control=ctl)
    async with app.run_test(size=(120, 40)) as pilot:
        await open_advice(pilot, app)
        (a,) = app.screen.advice
        plan = app.steering.plan_advice(a, app.current_engine())
        assert app.steer(plan, confirmed=True) is None
        await until(pilot, lambda: app.steering.advice_outcomes and app.steering.advice_outcomes[-1].done)
        out = app.steering.advice_outcomes[-1]
        assert not out.ok and "must be >= 28" in out.summary
        assert ctl.config.policy == "fcfs"                # all or nothing: nothing changed
        await pilot.press("1")
        await pilot.pause()
        alerts = text_of(app.screen.query_one("#alerts"))
        assert "advice sched_share" in alerts and "rejected" in alerts
        assert "must be >= 28" in alerts


async def test_a_restart_only_suggestion_is_shown_with_why_and_never_sent():
    ctl = FakeControl(EngineConfig(num_kv_blocks=1024, max_num_seqs=32, block_size=128))
    app = replay_app(records=list(generate(**FRAGMENTED)), control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_advice(pilot, app)
        (a,) = [x for x in screen.advice if x.rule == "fragmentation"]
        assert not a.hot and str(screen.table.get_cell(a.id, "mode")) == "restart"
        screen.table.move_cursor(row=screen.advice.index(a), animate=False)
        await pilot.pause()
        detail = text_of(screen.query_one("#adv-detail"))
        assert "restart-only" in detail and "--set block_size=64" in detail
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen) and sets(ctl) == []
        assert "restart" in app.steer(app.steering.plan_advice(a, app.current_engine()))
        texts = [t for t, _c, _h in ConsoleCommands(screen)._commands()]
        assert not [t for t in texts if "block_size" in t and t.startswith("Apply advice")]


async def test_read_only_shows_advice_but_never_applies_it():
    app = replay_app(records=list(generate(**SLOW)))          # a replay: read-only
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_advice(pilot, app)
        (a,) = screen.advice
        assert not [b for b in screen.active_bindings.values() if b.binding.action == "apply"]
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
        assert "read-only" in app.steer(app.steering.plan_advice(a, app.current_engine()))
        assert "read-only" in text_of(screen.query_one("#adv-summary"))
        texts = [t for t, _c, _h in ConsoleCommands(screen)._commands()]
        assert "Go to Advice" in texts and not [t for t in texts if t.startswith("Apply advice")]


async def test_help_and_palette_list_the_advice():
    ctl = FakeControl()
    app = replay_app(records=list(generate(**SLOW)), control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches)
        texts = [t for t, _c, _h in ConsoleCommands(app.screen)._commands()]
        assert "Go to Advice" in texts
        assert [t for t in texts if t.startswith("Apply advice: policy fcfs → hybrid")]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = text_of(app.screen.query_one("#help-text"))
        assert "Advice" in help_text and "apply the selected hot suggestion" in help_text


async def test_no_advice_says_what_is_watched():
    app = replay_app()                                        # the recording: nothing to say
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_advice(pilot, app)
        assert screen.advice == []
        assert "no advice" in text_of(screen.query_one("#adv-summary"))
        await pilot.press("1")
        await pilot.pause()
        assert not app.screen.query_one("#alerts").border_subtitle


# --- the box and the row behind it ------------------------------------------------------------

SEATS_CFG = EngineConfig(num_kv_blocks=1024, max_num_seqs=6)
T0 = 1_700_000_000.0


def seats_records(start: float, seconds: float, usage: float, seq0: int) -> list[Any]:
    """Every one of 6 seats taken, 20 requests waiting, the KV pool ``usage`` full: the seats
    rule suggests as many seats as the pool's usage per running request says fit under 85 %
    (usage 0.6: 8, usage 0.7: 7). A snapshot every half second."""
    out = []
    for i in range(int(seconds * 2)):
        ts, seq = start + i / 2, seq0 + i
        out += [
            (ts, frames("health", {"state": "running", "uptime_s": ts - T0 + 60, "steps": seq,
                                   "interval_s": 1.0, "alerts_active": {}}, seq=seq, ts=ts)),
            (ts, frames("sched", {"num_waiting": 20, "num_running": 6, "num_preempted": 0,
                                  "num_preemptions_total": 0, "max_num_seqs": 6,
                                  "max_num_batched_tokens": 2048, "policy": "fcfs",
                                  "requests": {}, "requests_truncated": 0}, seq=seq, ts=ts)),
            (ts, frames("kv", {"usage": usage, "fragmentation": 0.1, "num_used": 600,
                               "num_blocks": 1024, "block_size": 16}, seq=seq, ts=ts)),
            (ts, frames("step", {"steps": 30, "window_s": 0.5, "sched_share": 0.02,
                                 "step_time_p50_s": 0.016, "num_prefill_tokens": 40,
                                 "num_decode_tokens": 120}, seq=seq, ts=ts)),
        ]
    return out


async def test_the_advice_behind_an_open_box_holds_still_and_the_box_is_what_is_sent():
    ctl = FakeControl(SEATS_CFG)
    config = frames("config", {"version": 1, "values": SEATS_CFG.to_dict(),
                               "schema": describe_config()}, ts=T0)
    app = replay_app(records=[(T0, config), *seats_records(T0, 12, 0.6, 0)], control=ctl)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_advice(pilot, app)
        (a,) = screen.advice
        assert a.rule == "seats" and a.change == {"max_num_seqs": 8}
        await pilot.press("A")
        assert isinstance(app.screen, ConfirmScreen)
        box = app.screen
        assert "max_num_seqs 6 → 8" in box.title_text
        # The advisor moves on while the operator reads: the pool filled up, 7 seats fit now.
        app.state.feed(seats_records(T0 + 12, 12, 0.7, 24))
        assert app.state.advice(app.state.engine())[0].change == {"max_num_seqs": 7}
        app.refresh_view(force=True)
        await pilot.pause()
        assert app.screen is box
        assert screen.advice == [a]                         # the row behind the box: 6 → 8
        assert "max_num_seqs 6 → 8" in str(screen.table.get_cell(a.id, "change"))
        assert "max_num_seqs 6 → 8" in text_of(screen.query_one("#adv-detail"))
        await pilot.press("tab", "enter")                   # "Apply advice"
        await until(pilot, lambda: app.steering.advice_outcomes
                    and app.steering.advice_outcomes[-1].done)
        assert sets(ctl) == [{"max_num_seqs": 8}]           # what the box showed


async def test_a_cancelled_box_lets_the_advice_catch_up():
    ctl = FakeControl(SEATS_CFG)
    config = frames("config", {"version": 1, "values": SEATS_CFG.to_dict(),
                               "schema": describe_config()}, ts=T0)
    app = replay_app(records=[(T0, config), *seats_records(T0, 12, 0.6, 0)], control=ctl)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_advice(pilot, app)
        await pilot.press("A")
        assert isinstance(app.screen, ConfirmScreen)
        app.state.feed(seats_records(T0 + 12, 12, 0.7, 24))
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen and sets(ctl) == []
        (a,) = screen.advice
        assert a.change == {"max_num_seqs": 7}
        assert "max_num_seqs 6 → 7" in str(screen.table.get_cell(a.id, "change"))
