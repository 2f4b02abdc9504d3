"""Ray actor ranks as an operator sees them without Ray: the console's Ranks screen and `top
--json` name each rank's actor and node (from its ``dp`` body), process ranks add nothing, and
`vconsole doctor` reports Ray. Synthetic telemetry, no engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.widgets import Static

from support.console_testing import replay_app
from support.synthetic_dp import generate_dp
from vconsole.console.ranks import aggregate, placement_line
from vconsole.console.screens.ranks import RanksScreen
from vconsole.telemetry.schema import decode, encode
from vconsole.tools import doctor


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


def test_top_json_aggregate_carries_each_ranks_node_and_actor() -> None:
    bodies = {r: {"dp": {"world_size": 2, "node": f"n{r}", "actor": f"vconsole_dp_rank_{r}"}}
              for r in (0, 1)}
    agg = aggregate(bodies)
    assert agg["placement"] == {"0": {"node": "n0", "actor": "vconsole_dp_rank_0"},
                                "1": {"node": "n1", "actor": "vconsole_dp_rank_1"}}
    mp = aggregate({0: {"dp": {"world_size": 2, "node": "host", "actor": None}}})
    assert mp["placement"] == {"0": {"node": "host", "actor": None}}
    assert placement_line(mp["placement"]) == []


def test_doctor_reports_ray_and_a_cluster_ray_start_left(tmp_path: Path) -> None:
    current, token = tmp_path / "ray_current_cluster", tmp_path / "no_token"
    check = doctor.check_ray(current, token)
    assert check.status == doctor.OK and "--data-parallel-backend ray" in check.detail
    assert "`ray start`" not in check.detail
    current.write_text("10.0.0.1:6379\n")
    check = doctor.check_ray(current, token)
    assert "10.0.0.1:6379" in check.detail and "--ray-address auto" in check.detail
    assert doctor.check_ray in doctor.CHECKS


def test_doctor_warns_of_a_ray_token_file_others_can_read(tmp_path: Path) -> None:
    current, token = tmp_path / "ray_current_cluster", tmp_path / "auth_token"
    token.write_text("secret")
    token.chmod(0o600)
    check = doctor.check_ray(current, token)
    assert check.status == doctor.OK and f"auth token {token}" in check.detail
    for mode, who in ((0o644, "group and others"), (0o640, "group"), (0o604, "others")):
        token.chmod(mode)
        check = doctor.check_ray(current, token)
        assert check.status == doctor.WARN, check
        assert f"readable by {who} (mode {mode:o}): chmod 600 {token}" in check.detail
