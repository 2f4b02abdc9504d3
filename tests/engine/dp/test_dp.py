"""`vconsole engine --data-parallel-size 2`: two engine ranks behind one front end, as a client,
a console and an operator see them. One 2-rank engine serves the tests that take the `dp`
fixture (in order: the last of them kills a rank; the engine's clean stop is checked at
teardown); the torchrun test starts its own group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.support.live_engine import Telemetry, ipc_endpoints, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.child import ChildProcess
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire import protocol
from vconsole.wire.control_client import ControlClient
from vconsole.wire.ready_file import read_ready_file

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--data-parallel-size", "2", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "16", "--restart-backoff", "0.2",
               "--set", "heartbeat_interval_s=0.2", "--metrics-port", "0"]


class DP:
    def __init__(self, engine: EngineProcess, telemetry: Telemetry) -> None:
        self.engine = engine
        self.telemetry = telemetry

    def client(self) -> EngineClient:
        return EngineClient(self.engine.endpoints["input"], self.engine.endpoints["output"],
                            timeout_s=30).connect()

    def control(self) -> ControlClient:
        return ControlClient(self.engine.endpoints["control"], timeout_s=30,
                             key=self.engine.control_key())

    def ranks(self) -> list[dict[str, Any]]:
        record = read_ready_file(self.engine.ready_path)
        assert record is not None
        return record["ranks"]

    def steps(self, rank: int, since: float = 0.0) -> int:
        """The rank's step count from its latest ``health`` (0 if none yet)."""
        beats = [p for p in self.telemetry.topic("health", since) if p["rank"] == rank]
        return beats[-1]["steps"] if beats else 0


@pytest.fixture(scope="module")
def dp() -> Iterator[DP]:
    engine = EngineProcess(ENGINE_ARGS).start(timeout_s=180)
    telemetry = Telemetry(engine.endpoints["telemetry"])
    try:
        yield DP(engine, telemetry)
    finally:
        telemetry.close()
        code = engine.stop(grace_s=30)
    assert code == 0, engine.log_tail(40)


def test_the_ready_file_names_both_ranks_and_the_front_ends_endpoints(dp: DP) -> None:
    record = dp.engine.ready
    assert record["data_parallel_size"] == 2
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    pids = {r["pid"] for r in record["ranks"]}
    assert len(pids) == 2 and dp.engine.pid not in pids
    with dp.client() as c:
        assert c.engine_info["data_parallel_size"] == 2


def test_requests_spread_over_both_ranks_with_the_greedy_outputs_of_one_engine(dp: DP) -> None:
    work = [([3 + i, 17, 42 + 5 * i, 9, 100 + i], 12) for i in range(8)]
    expected = reference_outputs(work, block_size=8, num_kv_blocks=64)
    since = time.monotonic()
    with dp.client() as c:
        ids = [c.submit(prompt_token_ids=ids, max_tokens=n) for ids, n in work]
        done = c.gather(ids, timeout_s=120)
    assert [done[i].finish_reason for i in ids] == ["length"] * 8
    assert [done[i].output_token_ids for i in ids] == expected
    for rank in (0, 1):   # both ranks ran steps for this burst
        dp.telemetry.wait_for("health", lambda p, r=rank: p["rank"] == r and p["steps"] > 0,
                              timeout_s=10, since=since)


def test_the_public_telemetry_carries_every_ranks_messages(dp: DP) -> None:
    for rank in (0, 1):
        for topic in ("health", "sched", "kv", "config"):
            dp.telemetry.wait_for(topic, lambda p, r=rank: p["rank"] == r, timeout_s=10)


def test_bad_input_gets_its_reason_from_the_front_end_or_the_rank_and_serving_goes_on(
        dp: DP) -> None:
    ctx = zmq.Context.instance()
    ident = b"raw-client"
    inp, out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock, name in ((inp, "input"), (out, "output")):
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(dp.engine.endpoints[name])

        def reply(kind: str) -> dict[str, Any]:
            while out.poll(10_000):
                header = protocol.decode(out.recv_multipart())
                if header["type"] == kind:
                    return header
            raise AssertionError(f"no {kind} within 10 s")

        inp.send_multipart(protocol.encode_hello())
        assert reply("ready")["data_parallel_size"] == 2
        inp.send_multipart([b"\xc1 not msgpack"])               # the front end: no request id
        assert "undecodable" in reply("error")["reason"]
        inp.send_multipart(protocol.encode({"type": "add", "request_id": "bad",
                                            "prompt_token_ids": [1, 2],
                                            "sampling": {"max_tokens": -3}}))
        (bad,) = reply("outputs")["outputs"]                     # the rank refused it
        assert bad["request_id"] == "bad" and bad["finish_reason"] == "error" and bad["error"]
    finally:
        inp.close(0)
        out.close(0)
    with dp.client() as c:
        rid = c.submit(prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert c.gather([rid], timeout_s=60)[rid].finish_reason == "length"


def _last(dp: DP, topic: str, rank: int, since: float = 0.0) -> dict[str, Any]:
    """The rank's latest message on ``topic`` (waiting for a first one)."""
    dp.telemetry.wait_for(topic, lambda p: p["rank"] == rank, timeout_s=10, since=since)
    return [p for p in dp.telemetry.topic(topic, since) if p["rank"] == rank][-1]


def test_an_idle_rank_runs_dummy_steps_while_the_other_works_and_waves_advance(dp: DP) -> None:
    for rank in (0, 1):
        dp.telemetry.wait_for("dp", lambda p, r=rank: p["rank"] == r and p["group_state"] == "ok"
                              and p["world_size"] == 2, timeout_s=60)
    dummies = {r: _last(dp, "dp", r)["dummy_steps_total"] for r in (0, 1)}
    waves: list[int] = []

    def completed_by_both() -> int:
        """The newest wave every rank has said it completed (-1: none). A wave of an earlier
        test may still complete now, and one rank may say so a moment before the other."""
        by_rank: dict[int, set[int]] = {0: set(), 1: set()}
        for p in dp.telemetry.topic("wave"):
            if p["event"] == "complete":
                by_rank[p["rank"]].add(p["wave"])
        return max(by_rank[0] & by_rank[1], default=-1)

    with dp.client() as c:
        for _ in range(2):      # one request at a time: one rank works, the other waits
            before = completed_by_both()
            rid = c.submit(prompt_token_ids=[11, 12, 13], max_tokens=24)
            assert c.gather([rid], timeout_s=60)[rid].finish_reason == "length"
            deadline = time.monotonic() + 30
            while completed_by_both() <= before:   # every rank completes the same wave
                assert time.monotonic() < deadline, dp.telemetry.topic("wave")
                time.sleep(0.05)
            waves.append(completed_by_both())
    assert waves[1] > waves[0]
    last_wave = time.monotonic()
    for r in (0, 1):       # each rank's next dp snapshot after the last wave
        _last(dp, "dp", r, since=last_wave)
    grown = {r: _last(dp, "dp", r)["dummy_steps_total"] - dummies[r] for r in (0, 1)}
    assert max(grown.values()) > 0, grown      # the idle rank stepped a dummy batch
    # A rank that has only ever waited has only dummy steps (share 1); the one that worked
    # has real ones.
    shares = [_last(dp, "dp", r)["dummy_steps_total"] / max(1, _last(dp, "dp", r)["steps_total"])
              for r in (0, 1)]
    assert max(shares) > 0 and min(shares) < 1, shares


def test_the_front_ends_metrics_carry_every_rank_labelled_engine(dp: DP) -> None:
    def ranks_of(text: str, family: str) -> set[str]:
        return {line.split('engine="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith(family + "{")}

    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(dp.engine.ready["metrics"], timeout=10).read().decode()
        seen = (ranks_of(text, "vllm:num_requests_running"),
                ranks_of(text, "vconsole:dp_world_size"))
        if seen == ({"0", "1"}, {"0", "1"}) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == ({"0", "1"}, {"0", "1"})


def test_a_set_config_reaches_every_rank_with_one_acknowledgement_each(dp: DP) -> None:
    with dp.control() as ctl:
        reply = ctl.set_config({"max_num_seqs": 12})
        assert reply["ok"] and sorted(reply["ranks"]) == ["0", "1"]
        assert all(a["ok"] and a["applied"] == {"max_num_seqs": 12}
                   for a in reply["ranks"].values())
        for rank in (0, 1):
            got = ctl.request("get_config", fields={"rank": rank})
            assert got["rank"] == rank and got["values"]["max_num_seqs"] == 12


def test_a_set_config_with_a_rank_changes_only_that_rank(dp: DP) -> None:
    with dp.control() as ctl:
        assert ctl.set_config({"max_num_seqs": 12})["ok"]
        reply = ctl.request("set_config", {"max_num_seqs": 9}, fields={"rank": 1})
        assert reply["ok"] and list(reply["ranks"]) == ["1"]
        assert ctl.request("get_config", fields={"rank": 1})["values"]["max_num_seqs"] == 9
        assert ctl.request("get_config", fields={"rank": 0})["values"]["max_num_seqs"] == 12
        assert ctl.get_config()["values"]["max_num_seqs"] == 12     # no rank: rank 0's


def test_a_value_the_table_refuses_is_refused_for_every_rank_and_sent_to_none(dp: DP) -> None:
    with dp.control() as ctl:
        def versions() -> list[tuple[int, int]]:
            replies = [ctl.request("get_config", fields={"rank": r}) for r in (0, 1)]
            return [(g["version"], g["values"]["max_num_seqs"]) for g in replies]

        before = versions()
        reply = ctl.set_config({"max_num_seqs": 0})
        assert not reply["ok"] and "max_num_seqs" in reply["rejected"]
        assert reply["ranks"] == {}
        assert versions() == before             # no rank changed, not even its version
        bad_rank = ctl.request("get_config", fields={"rank": 2})
        assert not bad_rank["ok"] and "rank" in bad_rank["error"]


def test_a_set_config_without_the_front_ends_key_changes_nothing(dp: DP) -> None:
    with ControlClient(dp.engine.endpoints["control"], timeout_s=30, key="wrong") as ctl:
        reply = ctl.request("set_config", {"max_num_seqs": 5})
        assert not reply["ok"] and reply["error"].startswith("not authorised")


def _vconsole(dp: DP, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *argv, "--control",
                           dp.engine.endpoints["control"], "--control-key-file",
                           str(dp.engine.control_key_file)], capture_output=True, text=True,
                          timeout=60)


def test_vconsole_set_and_get_address_one_rank_with_rank(dp: DP) -> None:
    done = _vconsole(dp, "set", "--rank", "1", "max_num_seqs=7")
    assert done.returncode == 0, done.stderr
    assert "rank 1  applied" in done.stdout and "rank 0" not in done.stdout
    got = _vconsole(dp, "get", "--rank", "1", "--json", "max_num_seqs")
    assert got.returncode == 0 and '"max_num_seqs": 7' in got.stdout
    refused = _vconsole(dp, "set", "max_num_seqs=-1")
    assert refused.returncode == 1 and "rejected  max_num_seqs" in refused.stderr


def test_vconsole_stacks_says_which_rank_of_the_group_it_shows(dp: DP) -> None:
    pids = {r["rank"]: r["pid"] for r in dp.ranks()}
    base = [sys.executable, "-m", "vconsole", "stacks", "--telemetry",
            dp.engine.endpoints["telemetry"], "--method", "signal"]
    done = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"pid {pids[0]}, rank 0 of 2: "), done.stdout[:200]
    assert "data-parallel group of 2" in done.stderr and "--rank 1" in done.stderr
    one = subprocess.run([*base, "--rank", "1"], capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith(f"pid {pids[1]}, rank 1 of 2: ") and one.stderr == ""


def test_a_killed_rank_fails_its_requests_is_restarted_and_the_group_serves_again(dp: DP) -> None:
    before = {r["rank"]: r["pid"] for r in dp.ranks()}
    generation = _last(dp, "dp", 0)["group_generation"]
    since = time.monotonic()
    steps = {rank: dp.steps(rank) for rank in (0, 1)}
    with dp.client() as c:     # 2 x 200 tokens per rank: 50 of its 64 blocks, seconds of steps
        ids = [c.submit(prompt_token_ids=[5, 6, 7, i], max_tokens=200, ignore_eos=True)
               for i in range(4)]
        for rank in (0, 1):     # every request is running on its rank
            dp.telemetry.wait_for("health", lambda p, r=rank: p["rank"] == r
                                  and p["steps"] > steps[r] + 2, timeout_s=30, since=since)
        os.kill(before[1], signal.SIGKILL)
        done = c.gather(ids, timeout_s=120)
        errors = [d for d in done.values() if d.finish_reason == "error"]
        assert len(errors) == 2, [(d.finish_reason, d.error) for d in done.values()]
        assert all("data-parallel rank 1 died: killed by SIGKILL" in (d.error or "")
                   for d in errors)
        assert sorted(d.finish_reason for d in done.values()) == ["error", "error", "length",
                                                                 "length"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pid = next(r["pid"] for r in dp.ranks() if r["rank"] == 1)
            if pid not in (None, before[1]):
                break
            time.sleep(0.2)
        else:
            pytest.fail("rank 1 was not restarted")
        assert next(r["pid"] for r in dp.ranks() if r["rank"] == 0) == before[0]
        dp.telemetry.wait_for("health", lambda p: p["rank"] == 1 and p["state"] == "restarting",
                              timeout_s=5, since=since)
        after = time.monotonic()
        again = [c.submit(prompt_token_ids=[8, 9, i], max_tokens=8) for i in range(4)]
        done = c.gather(again, timeout_s=120)
    assert [done[i].finish_reason for i in again] == ["length"] * 4
    dp.telemetry.wait_for("health", lambda p: p["rank"] == 1 and p["pid"] == pid
                          and p["steps"] > 0, timeout_s=10, since=after)
    for rank in (0, 1):     # regrouped: both ranks in the next generation, coordinated again
        dp.telemetry.wait_for("dp", lambda p, r=rank: p["rank"] == r and p["group_state"] == "ok"
                              and p["group_generation"] > generation, timeout_s=60, since=after)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.long   # make test-long: test_dp_curve launches torchrun ranks too
def test_torchrun_launches_two_ranks_that_serve_behind_rank_0s_front_end(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    eps = ipc_endpoints(tmp_path)
    ready = tmp_path / "ready.json"
    cmd = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "vconsole", "engine",
           "--num-kv-blocks", "64", "--block-size", "8", "--set", "heartbeat_interval_s=0.2",
           "--ready-file", str(ready), *[f"--{n}={ep}" for n, ep in eps.items()]]
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = ChildProcess(cmd, stdout=out, stderr=subprocess.STDOUT, own_group=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while (record := read_ready_file(ready)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert record["data_parallel_size"] == 2 and len(record["ranks"]) == 2
        telemetry = Telemetry(eps["telemetry"])
        try:
            with EngineClient(eps["input"], eps["output"], timeout_s=30) as c:
                assert c.engine_info["data_parallel_size"] == 2
                ids = [c.submit(prompt_token_ids=[2, 4, 6, i], max_tokens=8) for i in range(6)]
                done = c.gather(ids, timeout_s=60)
            assert [done[i].finish_reason for i in ids] == ["length"] * 6
            for rank in (0, 1):
                telemetry.wait_for("health", lambda p, r=rank: p["rank"] == r and p["steps"] > 0,
                                   timeout_s=10)
        finally:
            telemetry.close()
        # Ctrl-C or a killpg reaches each rank twice, directly and passed on by torchrun's
        # agent; here a third, sent first, makes sure the repeats land before the drain ends.
        for r in record["ranks"]:
            os.kill(r["pid"], signal.SIGTERM)
        proc.stop(60)              # SIGTERM, the group (torchrun itself exits 1 on a signal)
        assert log.read_text().count("engine stopped (SIGTERM)") == 2   # every rank drained
    finally:
        proc.kill()


def test_the_launcher_refuses_a_public_endpoint_the_bind_policy_refuses_before_any_rank() -> None:
    done = subprocess.run([sys.executable, "-m", "vconsole", "engine", "--data-parallel-size",
                           "2", "--input", "tcp://0.0.0.0:5999"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "refusing to bind non-loopback endpoint(s) input=tcp://0.0.0.0:5999" in done.stderr
    assert "ready" not in done.stdout
