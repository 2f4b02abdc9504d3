"""The console, `vconsole top` and ``/metrics`` against a real ``vconsole engine
--data-parallel-size 2``: the front end's one telemetry endpoint carries both ranks, and what
each shows per rank must be what the ranks themselves said.

No fakes: a real launcher with two rank processes, real requests through the front end, Pilot at
80x24. The reference is the ranks' own telemetry (a subscriber of our own) after the load is
done, when every figure compared has stopped moving.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from textual.widgets import Static

from support.live_engine import Telemetry
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.ranks import RankRow, RanksScreen
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.tools import top

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--data-parallel-size", "2", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "8", "--metrics-port", "0",
               "--set", "heartbeat_interval_s=0.2", "--set", "telemetry_hz=20"]
REQUESTS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[tuple[EngineProcess, Telemetry]]:
    log = tmp_path_factory.mktemp("dp-console") / "engine.log"
    proc = EngineProcess(ENGINE_ARGS, log_path=log).start(timeout_s=180)
    telemetry = Telemetry(proc.endpoints["telemetry"])
    try:
        with EngineClient(proc.endpoints["input"], proc.endpoints["output"],
                          timeout_s=60).connect() as c:
            ids = [c.submit(prompt_token_ids=[3 + i, 17, 42, 9], max_tokens=6)
                   for i in range(REQUESTS)]
            done = c.gather(ids, timeout_s=120)
        assert all(done[i].finish_reason == "length" for i in ids)
        yield proc, telemetry
    finally:
        telemetry.close()
        proc.stop(grace_s=30)


def finished(telemetry: Telemetry, rank: int) -> int:
    rows = [p for p in telemetry.topic("sched") if p["rank"] == rank]
    return rows[-1]["num_finished_total"] if rows else -1


def settled(telemetry: Telemetry) -> dict[int, int]:
    """Each rank's finished count once their sum is every request sent."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = {r: finished(telemetry, r) for r in (0, 1)}
        if sum(got.values()) == REQUESTS:
            return got
        time.sleep(0.05)
    raise AssertionError(f"the ranks never reported {REQUESTS} finished requests")


async def test_the_console_shows_both_ranks_of_a_live_group_and_their_sum(engine):
    proc, telemetry = engine
    per_rank = settled(telemetry)
    app = VConsoleApp([proc.endpoints["telemetry"]], proc.endpoints["control"],
                      control_key=proc.control_key())
    async with app.run_test(size=(80, 24)) as pilot:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ranks = app.state.dp_ranks()
            # ... both reporting and both counted live (a heartbeat late on a busy machine
            # leaves a rank out of the sum until the next one).
            if len(ranks) == 2 and all("dp" in e.latest and "sched" in e.latest for e in ranks) \
                    and not app.state.dp_aggregate(ranks)["left_out"]:
                break
            await pilot.pause(0.1)
        ranks = app.state.dp_ranks()
        assert [e.rank for e in ranks] == [0, 1]
        assert {e.rank: e.latest["sched"]["num_finished_total"] for e in ranks} == per_rank
        agg = app.state.dp_aggregate(ranks)
        assert agg["num_finished_total"] == REQUESTS and agg["world_size"] == 2
        assert agg["group_states"] == {"ok": 2}
        await pilot.press("6")
        await pilot.pause()
        assert isinstance(app.screen, RanksScreen)
        rows = [str(r.render()) for r in app.screen.query(RankRow)]
        assert [r.split()[0] for r in rows] == ["r0", "r1"]
        summary = str(app.screen.query_one("#dp-summary", Static).render())
        assert "2 ranks" in summary and "group ok×2" in summary


def test_top_and_metrics_of_a_live_group_name_each_rank(engine):
    proc, telemetry = engine
    per_rank = settled(telemetry)
    snap, missing = top.snapshot_once(proc.endpoints["telemetry"], proc.endpoints["control"],
                                      20.0)
    assert missing == []
    assert set(snap["ranks"]) == {"0", "1"}
    assert {int(r): b["sched"]["num_finished_total"] for r, b in snap["ranks"].items()} == \
        per_rank
    assert snap["aggregate"]["num_finished_total"] == REQUESTS
    with urllib.request.urlopen(proc.ready["metrics"], timeout=10) as resp:
        text = resp.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    waves = {s.labels["engine"]: s.value for s in samples if s.name == "vconsole:dp_wave"}
    assert set(waves) == {"0", "1"}
    succeeded = {s.labels["engine"]: s.value for s in samples
                 if s.name == "vllm:request_success_total"
                 and s.labels.get("finished_reason") == "length"}
    assert sum(succeeded.values()) == REQUESTS
