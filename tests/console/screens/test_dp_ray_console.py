"""Ray actor ranks as an operator sees them without Ray: the console's Ranks screen names each
rank's actor and node (from its ``dp`` body), process ranks add nothing. Synthetic telemetry,
no engine. The aggregate's placement (what `top --json` prints): tests/console/test_ranks.py;
`vconsole doctor` on Ray: tests/tools/test_doctor.py."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static

from support.console_testing import replay_app
from support.synthetic_dp import generate_dp
from vconsole.console.screens.ranks import RanksScreen
from vconsole.telemetry.schema import decode, encode


def with_actors(records: list[Any]) -> list[Any]:
    """The records with each ``dp`` body saying where its rank runs, as a Ray rank's does."""
    out = []
    for t, frames in records:
        if bytes(frames[0]) == b"dp":
            payload = dict(decode(frames).payload)
            r = payload["rank"]
            payload.update(node=f"node-{'ab'[r]}", actor=f"vconsole_dp_rank_{r}")
            frames = encode("dp", payload)
        out.append((t, frames))
    return out


async def test_the_ranks_screen_names_each_ray_ranks_actor_and_node() -> None:
    app = replay_app(records=with_actors(list(generate_dp(2, 6.0))))
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.pause()
        await pilot.press("6")
        assert isinstance(app.screen, RanksScreen)
        await pilot.pause()
        where = app.screen.query_one("#dp-where", Static)
        assert where.display
        text = str(where.render())
        assert "r0 vconsole_dp_rank_0 on node-a" in text
        assert "r1 vconsole_dp_rank_1 on node-b" in text


async def test_process_ranks_get_no_actor_line() -> None:
    app = replay_app(records=list(generate_dp(2, 6.0)))
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.pause()
        await pilot.press("6")
        await pilot.pause()
        assert not app.screen.query_one("#dp-where", Static).display
