"""One console for a data-parallel group: every rank apart, their aggregate, the Ranks screen.

Fed a synthetic stream of N ranks on one endpoint (`support.synthetic_dp`, each rank a toy
engine with its own arrival rate, plus the ``dp`` and ``wave`` topics) and driven by Pilot at
80x24; a lone engine's console must not change at all.
"""

from __future__ import annotations

import pytest
from textual.widgets import Static

from support.console_testing import frames, replay_app
from support.synthetic import generate
from support.synthetic_dp import generate_dp
from vconsole.console.changes import APPLIED, ERROR, ChangeRecord
from vconsole.console.palette import ConsoleCommands
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.kvmap import KvScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.screens.ranks import RankRow, RanksScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets import dp_panels
from vconsole.console.widgets.chrome import TabBar

SIZE = (80, 24)


def text_of(widget: Static) -> str:
    return str(widget.render())


def dp_records(n: int, **kw) -> list:
    kw.setdefault("rates", [12.0] + [1.5] * (n - 1))   # rank 0 gets most of the load
    return list(generate_dp(n, kw.pop("duration_s", 12.0), **kw))


def fed(records) -> ConsoleState:
    st = ConsoleState(clock=lambda: records[-1][0])
    st.feed(records)
    return st


# --- the data model (no app) ------------------------------------------------------------------

def test_each_rank_is_kept_apart_and_the_aggregate_sums_the_serving_ones():
    recs = dp_records(2)
    st = fed(recs)
    ranks = st.dp_ranks()
    assert [e.rank for e in ranks] == [0, 1] and {e.engine for e in ranks} == {"engine-0"}
    r0, r1 = (e.latest for e in ranks)
    assert r0["sched"] is not r1["sched"]
    agg = st.dp_aggregate(ranks)
    assert agg["num_waiting"] == r0["sched"]["num_waiting"] + r1["sched"]["num_waiting"]
    assert agg["kv_usage"] == pytest.approx(
        (r0["kv"]["num_used"] + r1["kv"]["num_used"]) /
        (r0["kv"]["num_blocks"] + r1["kv"]["num_blocks"]))
    assert agg["wave"] == r0["dp"]["wave"] and agg["left_out"] == []
    assert agg["imbalanced"]      # 12 req/s against 1.5 req/s


def test_a_dead_rank_is_left_out_of_the_aggregate():
    recs = dp_records(2, stop_rank=(1, 0.5))
    st = fed(recs)
    ranks = st.dp_ranks()
    assert ranks[1].status(st.now()) == "down"
    agg = st.dp_aggregate(ranks)
    assert agg["left_out"] == [1]
    assert agg["num_running"] == ranks[0].latest["sched"]["num_running"]


def test_a_rank_the_front_end_reports_restarting_is_left_out_too():
    recs = dp_records(2)
    ts = recs[-1][0] + 0.01
    recs.append((ts, frames("health", {"state": "restarting", "uptime_s": 0.0, "steps": 0,
                                       "interval_s": 1.0, "restart_reason": "killed by SIGKILL"},
                            seq=10_000, ts=ts, engine="engine-0", rank=1)))
    st = fed(recs)
    ranks = st.dp_ranks()
    assert ranks[1].status(st.now()) == "restarting"
    assert st.dp_aggregate(ranks)["left_out"] == [1]
    agg = st.dp_aggregate(ranks)
    assert "1 down: r1" in dp_panels.aggregate_lines(agg, 200)[0]
    assert "restarting" in dp_panels.rank_row(ranks[1], agg, st.now(), 80, 1.0)


def test_a_change_acknowledged_per_rank_says_how_many_ranks_applied_it():
    both = ChangeRecord("max_num_seqs", 32, 16)
    both.take_reply({"ok": True, "version": 3, "applied": {"max_num_seqs": 16},
                     "ranks": {"0": {"ok": True}, "1": {"ok": True}}})
    assert both.status == APPLIED and both.summary() == "applied (v3) · 2/2 ranks acked"
    one = ChangeRecord("max_num_seqs", 32, 16)
    one.take_reply({"ok": False, "version": 3, "applied": {"max_num_seqs": 16},
                    "error": "rank 1: no reply", "ranks": {"0": {"ok": True},
                                                           "1": {"ok": False}}})
    assert one.status == ERROR and one.summary().endswith("rank 1: no reply · 1/2 ranks acked")
    lone = ChangeRecord("max_num_seqs", 32, 16)
    lone.take_reply({"ok": True, "version": 3, "applied": {"max_num_seqs": 16}})
    assert lone.summary() == "applied (v3)"


def test_a_lone_engine_or_unrelated_engines_are_not_a_group():
    assert fed(list(generate(duration_s=2))).dp_ranks() == []
    recs = sorted([*generate(duration_s=2, seed=1),
                   *generate(duration_s=2, seed=2, engine="tiny-1", rank=1)],
                  key=lambda r: r[0])
    assert fed(recs).dp_ranks() == []


# --- the app ----------------------------------------------------------------------------------

@pytest.mark.slow
async def test_two_ranks_at_80x24_overview_ranks_screen_and_kv_per_rank():
    app = replay_app(records=dp_records(2))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, OverviewScreen)
        assert "2 ranks" in text_of(app.screen.query_one("#summary"))
        panel = app.screen.query_one("#dp-panel")
        assert panel.display and "imbalance" in text_of(panel)
        assert "6 Ranks" in text_of(app.screen.query_one(TabBar)) or \
            " 6 " in text_of(app.screen.query_one(TabBar))
        assert app.screen.query_one("#queues").border_title == "Queues · rank 0"

        await pilot.press("6")
        assert isinstance(app.screen, RanksScreen)
        rows = [text_of(r) for r in app.screen.query(RankRow)]
        assert [r.split()[0] for r in rows] == ["r0", "r1"]
        assert all(r.region.height == 1 and r.region.y < SIZE[1] - 2
                   for r in app.screen.query(RankRow))
        summary = text_of(app.screen.query_one("#dp-summary"))
        assert "2 ranks" in summary and "⚠ imbalance" in summary and "wave" in summary
        assert "running" in rows[0] and "ok" in rows[1]

        await pilot.press("down", "enter")       # rank 1's KV map
        assert isinstance(app.screen, KvScreen) and app.selected_engine == "engine-0/1"
        await pilot.pause()
        assert "rank 1/2" in text_of(app.screen.query_one("#kv-zoom"))
        states = app.screen.grid.states
        await pilot.press("right_square_bracket")
        await pilot.pause()
        assert app.selected_engine == "engine-0/0"
        assert "rank 0/2" in text_of(app.screen.query_one("#kv-zoom"))
        assert app.screen.grid.states is not states
        await pilot.press("left_square_bracket")
        assert app.selected_engine == "engine-0/1"
        texts = [t for t, _c, _h in ConsoleCommands(app.screen)._commands()]
        assert {"Go to Ranks", "Next rank", "Previous rank"} <= set(texts)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and app.screen.dp
        assert "Ranks (data parallel)" in text_of(app.screen.query_one("#help-text"))


@pytest.mark.slow
async def test_eight_ranks_fit_at_80x24_and_every_row_is_reachable():
    app = replay_app(records=dp_records(8, duration_s=6.0, stop_rank=(5, 0.4)))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("6")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RanksScreen)
        rows = list(screen.query(RankRow))
        assert [text_of(r).split()[0] for r in rows] == [f"r{i}" for i in range(8)]
        assert "down" in text_of(rows[5])
        assert "1 down" in text_of(screen.query_one("#dp-summary"))
        box = screen.rows_box.region
        await pilot.press("end")
        assert screen.cursor == 7 and app.selected_engine == "engine-0/7"
        last = rows[7].region
        assert box.y <= last.y < box.bottom      # on screen, after scrolling if needed
        await pilot.press("home", "down", "down")
        assert app.selected_engine == "engine-0/2"
        await pilot.resize_terminal(80, 16)   # too small: says so, no crash
        await pilot.pause()
        await pilot.resize_terminal(120, 40)  # wide: load bars
        await pilot.pause()
        assert "load" in text_of(screen.query_one("#dp-header"))


@pytest.mark.slow
async def test_a_lone_engine_has_no_ranks_screen_tab_or_keys():
    app = replay_app(records=list(generate(duration_s=2)))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert " 6 " not in text_of(app.screen.query_one(TabBar))
        assert not app.screen.query_one("#dp-panel").display
        await pilot.press("6")
        assert isinstance(app.screen, OverviewScreen)
        await pilot.press("3", "right_square_bracket")
        assert isinstance(app.screen, KvScreen) and app.selected_engine is None
        assert "rank" not in text_of(app.screen.query_one("#kv-zoom"))
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and not app.screen.dp
