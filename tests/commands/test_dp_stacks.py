"""`vconsole stacks` on a data-parallel group says whose stacks it shows: rank 0's by default, of
how many, and that ``--rank`` reads another's. The engine's identity comes from real telemetry
on a real ZeroMQ socket (a publisher thread sends two ranks' ``dp`` and ``health``, rank 1
first); the live group's report is in tests/engine/dp/test_dp.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from vconsole.commands.stacks import EngineIdentity, engine_identity
from vconsole.shared import stacks
from vconsole.telemetry.schema import encode, make_envelope

PIDS = {0: 31_000, 1: 31_001}


def dp_body(world_size: int) -> dict[str, Any]:
    return {"world_size": world_size, "wave": 0, "wave_running": False, "group_generation": 0,
            "group_state": "ok", "steps_total": 0, "dummy_steps_total": 0, "dummy_share": 0.0,
            "sync_every": 4, "sync_count_total": 0, "sync_s_total": 0.0, "sync_s_per_step": 0.0}


def health_body(pid: int, state: str = "running") -> dict[str, Any]:
    return {"state": state, "uptime_s": 1.0, "steps": 0, "interval_s": 0.05, "pid": pid,
            "started_ts": 1.0}


@pytest.fixture
def publish() -> Iterator[Any]:
    """``publish(ranks, world_size, state)``: the telemetry endpoint of ``ranks`` heartbeating
    (each its ``dp`` then its ``health``, every 50 ms) until the test ends."""
    ctx = zmq.Context.instance()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(ranks: list[int], world_size: int, state: str = "running") -> str:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")

        def run() -> None:
            seq = 0
            try:
                while not stop.wait(0.05):
                    for r in ranks:
                        if world_size > 1:
                            pub.send_multipart(encode("dp", {**make_envelope(
                                "engine-0", r, seq, 1.0), **dp_body(world_size)}))
                        pub.send_multipart(encode("health", {**make_envelope(
                            "engine-0", r, seq, 1.0), **health_body(PIDS[r], state)}))
                    seq += 1
            finally:
                pub.close(0)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return f"tcp://127.0.0.1:{port}"

    yield start
    stop.set()
    for t in threads:
        t.join(5)


def test_a_group_gives_rank_0_by_default_and_says_of_how_many(publish: Any) -> None:
    endpoint = publish([1, 0], 2)
    assert engine_identity(endpoint, 10) == EngineIdentity(PIDS[0], None, None, 0, 2)
    assert engine_identity(endpoint, 10, rank=1) == EngineIdentity(PIDS[1], None, None, 1, 2)


def test_a_lone_engine_is_rank_0_of_1(publish: Any) -> None:
    assert engine_identity(publish([0], 1), 10) == EngineIdentity(PIDS[0], None, None, 0, 1)


def test_a_rank_the_group_does_not_have_is_refused_with_the_group_size(publish: Any) -> None:
    with pytest.raises(LookupError, match=r"no rank 5 on .*: the group has 2 rank\(s\) \(0\.\.1\)"):
        engine_identity(publish([1, 0], 2), 1.0, rank=5)


def test_a_restarting_rank_0_points_at_rank(publish: Any) -> None:
    with pytest.raises(LookupError, match=r"rank 0 of the group .* restarting .*--rank R"):
        engine_identity(publish([1, 0], 2, state="restarting"), 10)


def test_the_reports_first_line_names_the_rank_of_a_group_only() -> None:
    threads = (stacks.ThreadStack("MainThread", 1, (), busy_loop=True),)
    group = stacks.StackReport(PIDS[0], stacks.PY_SPY, threads, 0.0, rank=0, world_size=2)
    assert group.render().splitlines()[0].startswith(f"pid {PIDS[0]}, rank 0 of 2: 1 threads")
    assert group.to_json()["rank"] == 0 and group.to_json()["world_size"] == 2
    lone = stacks.StackReport(PIDS[0], stacks.PY_SPY, threads, 0.0, rank=0, world_size=1)
    assert lone.render().splitlines()[0].startswith(f"pid {PIDS[0]}: 1 threads")
