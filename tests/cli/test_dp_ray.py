"""`vconsole engine --data-parallel-size 2 --data-parallel-backend ray`: the ranks as Ray actors.

One engine for the module, on a local Ray it starts itself (its default: this machine's CPUs,
no dashboard): the tests run in order against it — 200 requests with a lone engine's greedy
outputs, waves and dummy steps, a rank actor killed with ``ray.kill`` under load — and the last
stops it and checks that no actor, placement group or Ray process of it is left. The test
process joins the engine's Ray (the address is in the ready file) only to look and to kill.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.live_engine import Telemetry, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.dp.ray.cluster import processes_of, use_token_if_any
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.launch.ready_file import read_ready_file

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--data-parallel-size", "2", "--data-parallel-backend", "ray",
               "--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "16",
               "--restart-backoff", "0.2", "--set", "heartbeat_interval_s=0.2"]


class RayDP:
    def __init__(self, engine: EngineProcess, telemetry: Telemetry) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.stopped: int | None = None

    def client(self) -> EngineClient:
        return EngineClient(self.engine.endpoints["input"], self.engine.endpoints["output"],
                            timeout_s=30).connect()

    def ranks(self) -> list[dict[str, Any]]:
        record = read_ready_file(self.engine.ready_path)
        assert record is not None
        return record["ranks"]

    def last(self, topic: str, rank: int, since: float = 0.0) -> dict[str, Any]:
        self.telemetry.wait_for(topic, lambda p: p["rank"] == rank, timeout_s=10, since=since)
        return [p for p in self.telemetry.topic(topic, since) if p["rank"] == rank][-1]

    def groups(self) -> dict[str, str]:
        """This engine's placement groups by name: their state (CREATED, REMOVED, ...)."""
        return {g["name"]: g["state"] for g in ray.util.placement_group_table().values()
                if g["name"].startswith("dp_rank_")}


@pytest.fixture(scope="module")
def dp() -> Iterator[RayDP]:
    engine = EngineProcess(ENGINE_ARGS).start(timeout_s=240)
    telemetry = Telemetry(engine.endpoints["telemetry"])
    rank0 = engine.ready["ranks"][0]
    use_token_if_any()       # the engine's Ray made a token (Ray's default): join with it
    ray.init(address=rank0["ray_address"], namespace=rank0["namespace"], log_to_driver=False,
             logging_level="ERROR")
    state = RayDP(engine, telemetry)
    try:
        yield state
    finally:
        telemetry.close()
        ray.shutdown()
        if state.stopped is None:
            engine.stop(grace_s=30)


def test_two_rank_actors_serve_200_requests_with_the_greedy_outputs_of_one_engine(
        dp: RayDP) -> None:
    ranks = dp.ranks()
    assert [r["actor"] for r in ranks] == ["vconsole_dp_rank_0", "vconsole_dp_rank_1"]
    assert all(r["node"] and r["actor_id"] for r in ranks)
    assert dp.groups() == {"dp_rank_0": "CREATED", "dp_rank_1": "CREATED"}
    assert {r["pid"] for r in ranks}.isdisjoint({dp.engine.pid})
    distinct = [([3 + i % 37, 17, 42 + i % 11, 9], 4 + i % 5) for i in range(40)]
    work = distinct * 5           # the lone engine computes each distinct request once
    expected = reference_outputs(distinct, block_size=8, num_kv_blocks=64) * 5
    since = time.monotonic()
    with dp.client() as c:
        ids = [c.submit(prompt_token_ids=ids, max_tokens=n) for ids, n in work]
        done = c.gather(ids, timeout_s=120)
    assert [done[i].output_token_ids for i in ids] == expected
    for rank in (0, 1):      # both actors worked, and their dp topic says where they run
        dp.telemetry.wait_for("health", lambda p, r=rank: p["rank"] == r and p["steps"] > 0,
                              timeout_s=10, since=since)
        body = dp.last("dp", rank)
        assert body["actor"] == f"vconsole_dp_rank_{rank}" and body["node"] == ranks[rank]["node"]


def test_an_idle_rank_actor_runs_dummy_steps_while_the_other_works_and_waves_advance(
        dp: RayDP) -> None:
    for rank in (0, 1):
        dp.telemetry.wait_for("dp", lambda p, r=rank: p["rank"] == r and p["group_state"] == "ok",
                              timeout_s=60)
    dummies = {r: dp.last("dp", r)["dummy_steps_total"] for r in (0, 1)}

    def completed_by_both() -> int:
        by_rank: dict[int, set[int]] = {0: set(), 1: set()}
        for p in dp.telemetry.topic("wave"):
            if p["event"] == "complete":
                by_rank[p["rank"]].add(p["wave"])
        return max(by_rank[0] & by_rank[1], default=-1)

    waves = []
    with dp.client() as c:
        for _ in range(2):      # one request at a time: one rank works, the other steps dummies
            before = completed_by_both()
            rid = c.submit(prompt_token_ids=[11, 12, 13], max_tokens=24)
            assert c.gather([rid], timeout_s=60)[rid].finish_reason == "length"
            deadline = time.monotonic() + 30
            while completed_by_both() <= before:
                assert time.monotonic() < deadline, dp.telemetry.topic("wave")
                time.sleep(0.05)
            waves.append(completed_by_both())
    assert waves[1] > waves[0]
    time.sleep(0.5)
    grown = {r: dp.last("dp", r)["dummy_steps_total"] - dummies[r] for r in (0, 1)}
    assert max(grown.values()) > 0, grown


def test_a_rank_actor_killed_with_ray_kill_fails_its_requests_comes_back_and_says_so(
        dp: RayDP) -> None:
    before = {r["rank"]: r for r in dp.ranks()}
    generation = dp.last("dp", 0)["group_generation"]
    since = time.monotonic()
    with dp.client() as c:
        ids = [c.submit(prompt_token_ids=[5, 6, 7, i], max_tokens=200, ignore_eos=True)
               for i in range(4)]
        for rank in (0, 1):     # both ranks are stepping these requests
            dp.telemetry.wait_for("sched", lambda p, r=rank: p["rank"] == r
                                  and p["num_running"] > 0, timeout_s=30, since=since)
        ray.kill(ray.get_actor("vconsole_dp_rank_1"))
        done = c.gather(ids, timeout_s=120)
        errors = [d.error for d in done.values() if d.finish_reason == "error"]
        assert sorted(d.finish_reason for d in done.values()) == ["error", "error", "length",
                                                                 "length"], errors
        assert all("data-parallel rank 1 died: Ray actor vconsole_dp_rank_1 killed by ray.kill"
                   in (e or "") for e in errors), errors
        down = dp.telemetry.wait_for("health", lambda p: p["rank"] == 1
                                     and p["state"] == "restarting", timeout_s=10, since=since)
        assert down["restart_count"] == 1 and "ray.kill" in down["restart_reason"]
        deadline = time.monotonic() + 120
        while (now := next(r for r in dp.ranks() if r["rank"] == 1))["actor_id"] in (
                None, before[1]["actor_id"]) or now["pid"] is None:
            assert time.monotonic() < deadline, "rank 1's actor was not restarted"
            time.sleep(0.2)
        assert next(r for r in dp.ranks() if r["rank"] == 0)["pid"] == before[0]["pid"]
        after = time.monotonic()
        again = [c.submit(prompt_token_ids=[8, 9, i], max_tokens=8) for i in range(6)]
        done = c.gather(again, timeout_s=120)
    assert [done[i].finish_reason for i in again] == ["length"] * 6
    back = dp.telemetry.wait_for("health", lambda p: p["rank"] == 1 and p["pid"] == now["pid"],
                                 timeout_s=10, since=after)
    assert back["restart_count"] == 1 and "ray.kill" in back["restart_reason"]
    for rank in (0, 1):     # regrouped: the waves go on with the actor that came back
        dp.telemetry.wait_for("dp", lambda p, r=rank: p["rank"] == r and p["group_state"] == "ok"
                              and p["group_generation"] > generation, timeout_s=60, since=after)
    assert dp.groups() == {"dp_rank_0": "CREATED", "dp_rank_1": "CREATED"}


def test_a_clean_stop_leaves_no_actor_placement_group_or_ray_process_behind(dp: RayDP) -> None:
    session = re.search(r"session folder (\S+)\)", dp.engine.log_text())
    assert session, dp.engine.log_tail(40)
    assert processes_of(session.group(1))           # the engine's own Ray runs
    groups_seen = dp.groups()
    ray.shutdown()                                  # the test leaves the engine's cluster first
    dp.stopped = dp.engine.stop(grace_s=60)
    assert dp.stopped == 0, dp.engine.log_tail(40)
    assert groups_seen == {"dp_rank_0": "CREATED", "dp_rank_1": "CREATED"}
    deadline = time.monotonic() + 10
    while (left := processes_of(session.group(1))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left


def test_the_ray_backend_without_ray_installed_exits_2_with_the_install_hint() -> None:
    done = subprocess.run(       # a Python where `import ray` finds nothing
        [sys.executable, "-c", "import sys; sys.modules['ray'] = None\n"
         "from vconsole.cli import main; sys.exit(main())", "engine",
         "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'vconsole[ray]'" in done.stderr
