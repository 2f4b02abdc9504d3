"""A rank that dies shows as down on the Ranks screen — its state, for how long and why, dashes for
its figures — and nothing it sent before dying counts in the group's figures, also once its new
process speaks and has not yet sent its own.

The stream: two synthetic ranks (`support.synthetic_dp`), rank 1 busy until it is killed at 6 s;
from then on the front end publishes ``health`` ``restarting`` for it every second with the
reason, as `vconsole.engine.dp.front.telemetry_proxy` does; optionally its new process's first
heartbeat, before that process's first ``sched``.
"""

from __future__ import annotations

from typing import Any

from textual.widgets import Static

from support.console_testing import frames, replay_app
from support.synthetic import T0
from support.synthetic_dp import generate_dp
from vconsole.console.engine_state import EngineState
from vconsole.console.screens.ranks import RankRow, RanksScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets import dp_panels
from vconsole.telemetry.schema import decode, encode

KILL_S, END_S = 6.0, 14.0
REASON = ("Ray actor vconsole_dp_rank_1 (pid 8734) died abruptly: killed by a signal (such as "
          "SIGKILL) or crashed; Ray keeps no exit status")


def restarting(t: float, seq: int) -> tuple[float, list[Any]]:
    """The front end's heartbeat for rank 1 while it is down (the front end's own pid)."""
    return t, frames("health", {"state": "restarting", "uptime_s": t - T0, "steps": 0,
                                "interval_s": 1.0, "pid": 777, "started_ts": T0 - 30,
                                "restart_count": 1, "restart_reason": REASON},
                     seq=seq, ts=t, engine="engine-0", rank=1)


def killed_stream(end_s: float = END_S, *, back_at: float | None = None) -> list[Any]:
    """Rank 1 busy (most of the load) until KILL_S, then restarting; ``back_at``: its new
    process's first heartbeat then (no ``sched`` of its own yet)."""
    recs = list(generate_dp(2, end_s, rates=[2.0, 12.0], stop_rank=(1, KILL_S / end_s)))
    beats = [restarting(T0 + KILL_S + 0.3 + i, 50_000 + i)
             for i in range(int(end_s - KILL_S)) if back_at is None or KILL_S + 0.3 + i < back_at]
    recs += beats
    if back_at is not None:      # the new process's heartbeats, and nothing else yet
        for i in range(int(end_s - back_at)):
            t = T0 + back_at + i
            recs.append((t, frames("health", {
                "state": "idle", "uptime_s": 0.5 + i, "steps": 0, "interval_s": 1.0,
                "pid": 5151, "started_ts": T0 + back_at - 0.5, "restart_count": 1,
                "restart_reason": REASON}, seq=i, ts=t, engine="engine-0", rank=1)))
    recs.sort(key=lambda r: r[0])
    return recs


def fed(records: list[Any]) -> ConsoleState:
    st = ConsoleState(clock=lambda: records[-1][0])
    st.feed(records)
    return st


def last_sched_before_kill(st: ConsoleState, rank: int) -> dict[str, Any]:
    return st.dp_ranks()[rank].latest["sched"]


def cells(row: str) -> list[str]:
    return str(Static(row).render()).split()


def test_a_killed_rank_shows_restarting_since_when_and_why_with_no_figures() -> None:
    st = fed(killed_stream())
    r0, r1 = st.dp_ranks()
    now = st.now()
    assert r1.status(now) == "restarting"
    assert r1.latest["sched"]["num_running"] > 0       # what it last sent: not live any more
    since = r1.down_since(now)
    assert since is not None and abs(since - (T0 + KILL_S + 0.3)) < 1e-6
    agg = st.dp_aggregate([r0, r1], now)
    row = cells(dp_panels.rank_row(r1, agg, now, 200, 1.0))
    assert row[:7] == ["r1", "●", "restarting", "–", "–", "–", "–"], row
    text = " ".join(row)
    assert "for 7.7s · Ray actor vconsole_dp_rank_1 (pid 8734) died abruptly" in text
    assert "memory" not in text


def test_the_aggregate_counts_only_the_live_rank() -> None:
    st = fed(killed_stream())
    r0, r1 = st.dp_ranks()
    agg = st.dp_aggregate([r0, r1])
    assert agg["left_out"] == [1]
    assert agg["num_running"] == r0.latest["sched"]["num_running"]
    assert agg["tokens_per_s"] == r0.latest["step"]["tokens_per_s"]
    assert "1 down: r1" in dp_panels.aggregate_lines(agg, 200)[0]
    assert "r1 –" in dp_panels.load_line([r0, r1], agg, 200)


def test_a_restarted_rank_shows_no_figure_of_its_previous_process() -> None:
    st = fed(killed_stream(back_at=10.0))
    r0, r1 = st.dp_ranks()
    now = st.now()
    assert r1.status(now) == "idle" and r1.down_since(now) is None
    stale = r1.latest["sched"]          # the killed process's last, 4 s old
    assert stale["num_running"] > 0 and "sched" not in r1.live_bodies()
    agg = st.dp_aggregate([r0, r1], now)
    assert agg["left_out"] == []
    assert agg["num_running"] == r0.latest["sched"]["num_running"]
    assert agg["tokens_per_s"] == r0.latest["step"]["tokens_per_s"]
    row = cells(dp_panels.rank_row(r1, agg, now, 80, 1.0))
    assert row[:6] == ["r1", "●", "idle", "–", "–", "–"], row


def test_a_rank_gone_silent_shows_down_since_its_last_heartbeat() -> None:
    recs = list(generate_dp(2, 12.0, stop_rank=(1, 0.5)))
    st = fed(recs)
    r1: EngineState = st.dp_ranks()[1]
    now = st.now()
    assert r1.status(now) == "down" and r1.down_since(now) == r1.last_heartbeat
    row = cells(dp_panels.rank_row(r1, st.dp_aggregate(st.dp_ranks(), now), now, 200, 1.0))
    assert row[:7] == ["r1", "●", "down", "–", "–", "–", "–"], row
    assert row[7] == "for" and "no heartbeat" in " ".join(row)


async def test_the_ranks_screen_shows_the_killed_rank_as_restarting_without_figures() -> None:
    app = replay_app(records=killed_stream())
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.pause()
        await pilot.press("6")
        assert isinstance(app.screen, RanksScreen)
        await pilot.pause()
        rows = [str(r.render()) for r in app.screen.query(RankRow)]
        assert rows[1].split()[:7] == ["r1", "●", "restarting", "–", "–", "–", "–"], rows
        assert "for 7.7s · Ray actor vconsole_dp_rank_1" in rows[1]  # the reason, clipped to
        # the width (the Alerts screen has it whole)


async def test_a_ray_ranks_row_leaves_out_the_actor_name_it_already_shows() -> None:
    """The reason without "Ray actor vconsole_dp_rank_1": at 100 columns what happened fits."""
    records = []
    for t, fr in killed_stream():
        if bytes(fr[0]) == b"dp":
            payload = dict(decode(fr).payload)
            payload["actor"] = f"vconsole_dp_rank_{payload['rank']}"
            fr = encode("dp", payload)
        records.append((t, fr))
    app = replay_app(records=records)
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.pause()
        await pilot.press("6")
        await pilot.pause()
        row = str(list(app.screen.query(RankRow))[1].render())
        assert "for 7.7s · (pid 8734) died abruptly" in row, row
        summary = str(app.screen.query_one("#dp-summary", Static).render())
        assert "(1 down: r1)" in summary
