"""`vconsole engine --data-parallel-size 2 --data-parallel-backend ray`: the ranks as Ray actors.

One engine for the module, on a local Ray it starts itself (its default: this machine's CPUs,
no dashboard): the tests run in order against it — 200 requests with a lone engine's greedy
outputs, waves and dummy steps, its Ray on loopback only, its Ray's private token and no secret
in Ray's files, a rank actor killed with ``ray.kill`` under load, a rank actor's process killed
with SIGKILL (not taken for out of memory), a rank whose loop ends with exit code 3, a Ray call
that times out — and the last stops it and checks that no actor, placement group or Ray
process of it is left. The test process joins the engine's Ray (the address is in the ready
file, the token in its session folder) only to look and to kill.

A second engine (long) is stopped while its Ray starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live_engine import Telemetry, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.dp.ray.cluster import (
    RAY_DIR,
    TOKEN_FILE,
    processes_of,
    use_loopback,
    use_token_file,
)
from vconsole.engine.dp.ray.launcher import STOPPED, TIMED_OUT, wait_for
from vconsole.engine.launch.child import engine_command
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire import exit_codes
from vconsole.wire.ready_file import read_ready_file

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--data-parallel-size", "2", "--data-parallel-backend", "ray",
               "--num-kv-blocks", "256", "--block-size", "8", "--max-num-seqs", "16",
               "--restart-backoff", "0.2", "--set", "heartbeat_interval_s=0.2"]
# In the engine's environment: none of it may reach a rank's runtime env or Ray's logs.
SECRETS = {"HF_TOKEN": "hf_secret_0b5e1c", "VCONSOLE_API_KEY": "vc_secret_77d2a9"}
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


class RayDP:
    def __init__(self, engine: EngineProcess, telemetry: Telemetry, session: Path) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.session = session          # the engine's Ray's session folder
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
    engine = EngineProcess(ENGINE_ARGS, env=SECRETS).start(timeout_s=240)
    telemetry = Telemetry(engine.endpoints["telemetry"])
    rank0 = engine.ready["ranks"][0]
    session = re.search(r"session folder (\S+)\)", engine.log_text())
    assert session, engine.log_tail(40)
    saved = {k: os.environ.get(k) for k in AUTH_ENV}
    use_token_file(Path(session.group(1)) / TOKEN_FILE)    # the engine's Ray's own token
    use_loopback()                              # ... which is on 127.0.0.1 only
    ray.init(address=rank0["ray_address"], namespace=rank0["namespace"], log_to_driver=False,
             logging_level="ERROR")
    state = RayDP(engine, telemetry, Path(session.group(1)))
    try:
        yield state
    finally:
        telemetry.close()
        ray.shutdown()
        use_loopback(False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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
    expected = reference_outputs(distinct, block_size=8, num_kv_blocks=256) * 5
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
    last_wave = time.monotonic()
    for r in (0, 1):       # each rank's next dp snapshot after the last wave
        dp.last("dp", r, since=last_wave)
    grown = {r: dp.last("dp", r)["dummy_steps_total"] - dummies[r] for r in (0, 1)}
    assert max(grown.values()) > 0, grown


def test_a_rank_actor_killed_with_ray_kill_fails_its_requests_comes_back_and_says_so(
        dp: RayDP) -> None:
    before = {r["rank"]: r for r in dp.ranks()}
    generation = dp.last("dp", 0)["group_generation"]
    since = time.monotonic()
    with dp.client() as c:
        # Long (800 tokens: 2,048 fit a rank's pool) so that they are still in flight when the
        # kill lands, also on a loaded machine.
        ids = [c.submit(prompt_token_ids=[5, 6, 7, i], max_tokens=800, ignore_eos=True)
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


def test_the_engines_own_ray_is_on_loopback_only(dp: RayDP) -> None:
    """The ready file's addresses are 127.0.0.1 (as docs/data-parallel.md says), and the Ray
    it started listens on nothing else."""
    import psutil

    for r in dp.ranks():
        assert r["node_ip"] == "127.0.0.1" and r["ray_address"].startswith("127.0.0.1:"), r
    listening = {}
    for pid in processes_of(dp.session):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[f"{proc.name()}:{conn.laddr.port}"] = conn.laddr.ip
    names = {k.split(":")[0] for k in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    assert {ip.removeprefix("::ffff:") for ip in listening.values()} == {"127.0.0.1"}, listening


def test_a_rank_actors_process_killed_with_sigkill_is_not_called_out_of_memory(
        dp: RayDP) -> None:
    """Ray's text for any abrupt death lists the OOM killer among possible causes; the reason
    the clients, the log and the telemetry get says what is known: killed or crashed."""
    before = next(r for r in dp.ranks() if r["rank"] == 1)
    since = time.monotonic()
    with dp.client() as c:
        ids = [c.submit(prompt_token_ids=[6, 7, 8, i], max_tokens=800, ignore_eos=True)
               for i in range(4)]
        dp.telemetry.wait_for("sched", lambda p: p["rank"] == 1 and p["num_running"] > 0,
                              timeout_s=30, since=since)
        os.kill(before["pid"], signal.SIGKILL)
        done = c.gather(ids, timeout_s=120)
    errors = [d.error or "" for d in done.values() if d.finish_reason == "error"]
    assert errors, [d.finish_reason for d in done.values()]
    expected = (f"data-parallel rank 1 died: Ray actor vconsole_dp_rank_1 (pid {before['pid']}) "
                "died abruptly: killed by a signal (such as SIGKILL) or crashed")
    assert all(expected in e for e in errors), errors
    down = dp.telemetry.wait_for("health", lambda p: p["rank"] == 1
                                 and p["state"] == "restarting", timeout_s=10, since=since)
    assert "died abruptly" in down["restart_reason"], down
    assert "memory" not in down["restart_reason"]
    logged = [ln for ln in dp.engine.log_text().splitlines()
              if "data-parallel rank 1: " in ln and "died abruptly" in ln]
    assert logged and not any("memory" in ln for ln in logged), logged
    deadline = time.monotonic() + 120
    while (now := next(r for r in dp.ranks() if r["rank"] == 1))["actor_id"] in (
            None, before["actor_id"]) or now["pid"] is None:
        assert time.monotonic() < deadline, "rank 1's actor was not restarted"
        time.sleep(0.2)


def test_the_engines_ray_runs_with_its_private_token_and_no_secret_reaches_ray(
        dp: RayDP) -> None:
    token = dp.session / TOKEN_FILE
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    # Ray makes its --temp-dir 0777: it is a subfolder of ours, which no other user enters.
    assert stat.S_IMODE(dp.session.stat().st_mode) == 0o700 and (dp.session / RAY_DIR).is_dir()
    import psutil

    servers = {}
    for pid in processes_of(dp.session):
        with_env = psutil.Process(pid)
        name = with_env.name()
        if name in ("gcs_server", "raylet"):
            servers[name] = with_env.environ()
    assert set(servers) == {"gcs_server", "raylet"}, servers.keys()
    for env in servers.values():     # token auth on, with our token (whatever ~/.ray holds)
        assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_AUTH_TOKEN_PATH") == \
            str(token) and "RAY_AUTH_TOKEN" not in env
    actor = ray.get_actor("vconsole_dp_rank_0")
    rank_env = ray.get(actor.__ray_call__.remote(lambda _: dict(os.environ)), timeout=30)
    assert rank_env.get("HF_HUB_OFFLINE") == "1"        # what a model load needs: there
    leaked = [k for k, v in rank_env.items() if v in SECRETS.values()]
    assert leaked == [], leaked
    for path in dp.session.rglob("*"):      # Ray's logs (runtime_env_agent.log, ...) too
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert not any(v.encode() in data for v in SECRETS.values()), path


def test_a_rank_whose_loop_ends_with_an_error_exit_code_is_restarted(dp: RayDP) -> None:
    def _end_the_loop_with_exit_code_3(actor: Any) -> None:     # in the actor (by value)
        actor.proc.exit_code = exit_codes.STEP_FAILURES        # as after failed steps
        actor.stop("the test: the loop ends with STEP_FAILURES")

    before = next(r for r in dp.ranks() if r["rank"] == 1)
    restarts = dp.last("health", 1)["restart_count"]
    since = time.monotonic()
    ray.get(ray.get_actor("vconsole_dp_rank_1").__ray_call__.remote(
        _end_the_loop_with_exit_code_3), timeout=30)
    down = dp.telemetry.wait_for("health", lambda p: p["rank"] == 1
                                 and p["state"] == "restarting", timeout_s=30, since=since)
    assert down["restart_count"] == restarts + 1
    assert f"engine exit code {exit_codes.STEP_FAILURES}" in down["restart_reason"], down
    deadline = time.monotonic() + 120
    while True:
        assert dp.engine.child.poll() is None, dp.engine.log_tail(40)    # the group goes on
        now = next(r for r in dp.ranks() if r["rank"] == 1)
        if now["actor_id"] not in (None, before["actor_id"]) and now["pid"] is not None:
            break
        assert time.monotonic() < deadline, f"rank 1 was not restarted: {dp.engine.log_tail(40)}"
        time.sleep(0.2)
    with dp.client() as c:
        again = [c.submit(prompt_token_ids=[4, 5, i], max_tokens=8) for i in range(6)]
        done = c.gather(again, timeout_s=120)
    assert [done[i].finish_reason for i in again] == ["length"] * 6
    assert dp.groups() == {"dp_rank_0": "CREATED", "dp_rank_1": "CREATED"}


def test_a_ray_call_that_times_out_is_not_taken_for_a_stop(dp: RayDP) -> None:
    def nap(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    task = ray.remote(num_cpus=0)(nap)      # the ranks' bundles hold every CPU
    stop = threading.Event()
    refs = [task.remote(30), task.remote(30)]
    try:
        assert wait_for(ray, refs[0], 1.0, stop.is_set) is TIMED_OUT
        stop.set()
        assert wait_for(ray, refs[1], 30, stop.is_set) is STOPPED
        assert wait_for(ray, task.remote(0), 60, lambda: False) == 0
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)


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
    assert not Path(session.group(1)).exists()


def _ray_start_of(pid: int) -> Path | None:
    """The private folder of the ``ray start`` that engine ``pid`` runs, once it runs."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "start" in cmd and "--temp-dir" in cmd:
            return Path(cmd[cmd.index("--temp-dir") + 1]).parent
    return None


@pytest.mark.long
def test_a_sigterm_while_ray_starts_stops_the_engine_before_any_rank_starts(
        tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        engine = subprocess.Popen(
            engine_command([*ENGINE_ARGS, "--ready-file", str(tmp_path / "ready.json")]),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    session: Path | None = None
    try:
        deadline = time.monotonic() + 120
        while (session := _ray_start_of(engine.pid)) is None:
            assert engine.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "started a local Ray" not in log.read_text()      # still starting
        engine.send_signal(signal.SIGTERM)
        code = engine.wait(timeout=90)
    finally:
        if engine.poll() is None:       # the test failed: leave nothing of it behind
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait()
            for pid in processes_of(session) if session else ():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if session:
                shutil.rmtree(session, ignore_errors=True)
    assert session is not None
    text = log.read_text()
    assert code == 0, text
    assert " ready (Ray actor" not in text, text                 # no rank started
    deadline = time.monotonic() + 10
    while (left := processes_of(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left
    assert not session.exists(), text


def test_the_ray_backend_without_ray_installed_exits_2_with_the_install_hint() -> None:
    done = subprocess.run(       # a Python where `import ray` finds nothing
        [sys.executable, "-c", "import sys; sys.modules['ray'] = None\n"
         "from vconsole.cli import main; sys.exit(main())", "engine",
         "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'vconsole[ray]'" in done.stderr
