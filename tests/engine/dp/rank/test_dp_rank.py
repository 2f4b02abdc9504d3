"""An engine process as a data-parallel rank: the dummy step, `DPRank` over a real store and
gloo group, and two real rank processes driven by the test acting as their front end.

The process tests share one group of two ranks (starting one costs seconds on 2 cores) and run
in file order: form the group, a wave driven by rank 0's requests, the next wave, then rank 1
is killed and rank 0 goes on alone.
"""

import datetime
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq

from support.live_engine import Telemetry, ipc_endpoints, reference_outputs
from vconsole.engine.core import EngineCore
from vconsole.engine.dp.rank.dp_rank import DPRank, split_cpu_threads
from vconsole.engine.dp.rank.rendezvous import (
    DPEnv,
    RendezvousError,
    connect_store,
    publish_rank,
    read_rank,
)
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.process.core_proc import EngineCoreProc
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.shared.config import EngineConfig
from vconsole.telemetry import schema
from vconsole.wire import protocol
from vconsole.wire.sampling import SamplingParams

# The group tests run in order on one two-rank group (waves 0, 1, 2 ...): under pytest-xdist the
# module stays on one worker (`make test` runs --dist loadgroup), or a worker given only the
# later ones starts a fresh group whose first wave is 0.
pytestmark = pytest.mark.xdist_group("dp-rank-group")

WORK = [([5, 9, 13, 2, 7], 6), ([40, 41, 42], 9), ([100] * 11, 5), ([3, 1, 4, 1, 5, 9, 2], 7)]


def store_master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


# --- in process: the dummy step ------------------------------------------------------------

@pytest.fixture(scope="module")
def core():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield EngineCore(EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=16))
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_dummy_steps_between_real_steps_leave_greedy_outputs_unchanged(core):
    for i, (ids, n) in enumerate(WORK):
        core.add_request(core.make_request(f"d{i}", prompt_token_ids=ids,
                                           sampling=SamplingParams(max_tokens=n)))
    results: dict[str, list[int]] = {f"d{i}": [] for i in range(len(WORK))}
    steps = core.num_steps
    while core.has_unfinished_requests():
        core.dummy_step()
        outputs, _ = core.step()
        core.dummy_step()
        for outs in outputs.values():
            for out in outs:
                results[out.request_id].extend(out.new_token_ids)
    assert [results[f"d{i}"] for i in range(len(WORK))] == reference_outputs(WORK)
    assert core.consecutive_step_failures == 0
    assert core.num_steps > steps                 # dummy steps are not engine steps


@pytest.mark.slow
def test_a_dummy_step_writes_no_kv_block_and_no_request_state(core):
    core.add_request(core.make_request("kv", prompt_token_ids=[7] * 12,
                                       sampling=SamplingParams(max_tokens=4)))
    core.step()                                   # the prompt's K/V are in the pool now
    before = [(k.clone(), v.clone()) for k, v in core.runner.kv_caches]
    state = core.runner.requests["kv"]
    held = (list(state.token_ids), list(state.block_ids), state.num_computed_tokens)
    core.dummy_step()
    for (k0, v0), (k1, v1) in zip(before, core.runner.kv_caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert list(core.runner.requests) == ["kv"]
    assert (state.token_ids, state.block_ids, state.num_computed_tokens) == held
    core.abort_requests(["kv"])
    while core.has_unfinished_requests():
        core.step()


@pytest.mark.proc
@pytest.mark.slow
def test_a_lone_engine_refuses_dp_messages_and_keeps_serving(core, tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path / "run"))
    proc = EngineCoreProc(core.config, ipc_endpoints(tmp_path), core=core)
    assert not proc.role.is_rank and not proc.role.in_wave
    proc.start()
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    link = Link(proc.endpoints)
    try:
        assert (link.ready["dp_rank"], link.ready["data_parallel_size"]) == (0, 1)
        link.send(protocol.encode_start_wave(0))
        link.send(protocol.encode_regroup(0))
        for kind in ("start_wave", "regroup"):
            err = link.wait(lambda h, k=kind: h["type"] == "error" and h["reason"].startswith(k))
            assert "not a data-parallel rank" in err["reason"] and err["request_id"] is None
        link.add("x", *WORK[0])
        link.wait_finished(["x"])
        assert link.tokens["x"] == reference_outputs([WORK[0]])[0]
        assert not [h for h in link.headers if h["type"] == "wave"]
    finally:
        link.close()
        proc.request_shutdown("test")
        loop.join(30)
    assert not loop.is_alive()


def test_cpu_ranks_split_the_cores_unless_omp_num_threads_decides():
    env = DPEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=None)
    cpu = EngineConfig(device="cpu")
    before = torch.get_num_threads()
    try:
        assert split_cpu_threads(env, cpu, {"OMP_NUM_THREADS": "3"}) is None
        assert split_cpu_threads(env, cpu, {}) == max(1, (os.cpu_count() or 1) // 2)
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
        assert split_cpu_threads(env, cpu, {"LOCAL_WORLD_SIZE": "64"}) == 1
    finally:
        torch.set_num_threads(before)


# --- in process: DPRank over a real store and a one-rank gloo group -------------------------

def test_an_unreachable_store_fails_at_once_with_a_clear_error():
    with pytest.raises(RendezvousError, match=r"cannot reach the data-parallel store at "
                                              r"127\.0\.0\.1:1 within 1 s"):
        connect_store(DPEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1",
                            master_port=1), timeout_s=1.0)


def test_rank_records_go_through_the_store():
    master = store_master()
    env = DPEnv(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1",
                master_port=master.port)
    client = connect_store(env, 5.0)
    publish_rank(client, 1, {"pid": 42, "endpoints": {"input": "ipc://x"}})
    assert read_rank(master, 1, 1.0) == {"pid": 42, "endpoints": {"input": "ipc://x"}}
    with pytest.raises(TimeoutError, match="rank 0 published no ready record within 0.2 s"):
        read_rank(master, 0, 0.2)


def test_dp_rank_runs_a_wave_and_publishes_every_dp_field():
    master = store_master()
    env = DPEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                master_port=master.port)
    now = [100.0]
    rank = DPRank(env, EngineConfig(dp_sync_every=2, dp_group_timeout_s=10),
                  clock=lambda: now[0])
    try:
        assert rank.maybe_start(has_work=True) is None          # no group yet: uncoordinated
        assert rank.dp_body()["group_state"] == "none"
        seen = []
        rank.regroup(0, before_form=lambda: seen.append(rank.group_state))
        assert seen == ["forming"] and rank.group_state == "ok"
        rank.regroup(0)                                          # stale generation: ignored
        assert rank.generation == 0 and rank.group_state == "ok"
        start = rank.maybe_start(has_work=True)
        assert (start.event, start.wave, start.notify) == ("start", 0, True)
        assert rank.after_step(dummy=False, busy=True) is None
        assert rank.after_step(dummy=False, busy=True) is None  # synced: still busy
        assert rank.after_step(dummy=True, busy=False) is None
        now[0] = 101.5
        done = rank.after_step(dummy=True, busy=False)           # synced: nobody busy
        assert (done.event, done.wave, done.notify) == ("complete", 0, True)
        assert done.body == {"event": "complete", "wave": 0, "steps": 4, "dummy_steps": 2,
                             "duration_s": 1.5}
        body = rank.dp_body()
        assert set(schema.TOPIC_FIELDS["dp"]) <= set(body)
        assert body["wave"] == 1 and body["wave_running"] is False
        assert (body["steps_total"], body["dummy_steps_total"], body["dummy_share"]) == (4, 2, 0.5)
        assert (body["sync_count_total"], body["group_generation"]) == (2, 0)
        assert rank.dp_body()["dummy_share"] == 0.0             # no step since the last body
        joined = rank.on_start_wave(1)
        assert (joined.event, joined.wave, joined.notify) == ("start", 1, False)
    finally:
        rank.close()
    assert not dist.is_initialized()


def test_the_publisher_repeats_the_dp_state_and_sends_each_wave_event_once():
    ctx = zmq.Context()
    pub = TelemetryPublisher(ctx, "tcp://127.0.0.1:*", "rank-1", 1,
                             EngineConfig(heartbeat_interval_s=0.1, telemetry_hz=20.0))
    pub.start()
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(pub.endpoint)
    try:
        msgs: list[schema.TelemetryMessage] = []

        def until(pred, timeout_s=5.0):
            deadline = time.monotonic() + timeout_s
            while not pred() and time.monotonic() < deadline:
                if sub.poll(50):
                    msgs.append(schema.decode(sub.recv_multipart()))
            assert pred()

        until(lambda: any(m.topic == "health" for m in msgs))   # connected
        body = {"world_size": 2, "wave": 3, "wave_running": False, "group_generation": 0,
                "group_state": "ok", "steps_total": 10, "dummy_steps_total": 4,
                "dummy_share": 0.4, "sync_every": 4, "sync_count_total": 2,
                "sync_s_total": 0.01, "sync_s_per_step": 0.001}
        pub.submit_wave({"event": "start", "wave": 3, "steps": 0, "dummy_steps": 0,
                         "duration_s": 0.0})
        pub.submit_wave({"event": "complete", "wave": 3, "steps": 8, "dummy_steps": 2,
                         "duration_s": 0.5})
        pub.submit_dp(body)
        until(lambda: sum(m.topic == "dp" for m in msgs) >= 3)   # submitted once, repeated
        dps = [m.payload for m in msgs if m.topic == "dp"]
        assert all({k: p[k] for k in body} == body and p["rank"] == 1 for p in dps)
        waves = [(m.payload["event"], m.payload["wave"]) for m in msgs if m.topic == "wave"]
        assert waves == [("start", 3), ("complete", 3)]
    finally:
        sub.close(0)
        pub.close()
        ctx.destroy(0)
    assert pub.error is None


# --- two rank processes, the test as their front end --------------------------------------

class Link:
    """The front end's side of one rank: two DEALERs with one identity, hello → ready."""

    def __init__(self, endpoints: dict[str, str], identity: bytes = b"dpfe-test") -> None:
        ctx = zmq.Context.instance()
        self.inp, self.out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (self.inp, self.out):
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.inp.connect(endpoints["input"])
        self.out.connect(endpoints["output"])
        self.headers: list[dict[str, Any]] = []
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.send(protocol.encode_hello())
        self.ready = self.wait(lambda h: h["type"] == "ready")

    def send(self, frames: protocol.Frames) -> None:
        self.inp.send_multipart(frames, copy=False)

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        self.send(protocol.encode_add(rid, prompt_token_ids=ids,
                                      sampling={"max_tokens": max_tokens}))

    def _pump(self, timeout_ms: int) -> None:
        while self.out.poll(timeout_ms):
            header = protocol.decode(self.out.recv_multipart())
            timeout_ms = 0
            if header["type"] == "heartbeat":
                continue
            self.headers.append(header)
            if header["type"] == "outputs":
                for out in protocol.parse_outputs(header):
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        self.finished[out.request_id] = out

    def wait(self, pred, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for h in self.headers:
                if pred(h):
                    return h
            self._pump(50)
        raise AssertionError(f"no matching message within {timeout_s} s; got "
                             f"{[h['type'] for h in self.headers][-20:]}")

    def wave_event(self, event: str, wave: int | None = None, timeout_s: float = 60.0
                   ) -> dict[str, Any]:
        return self.wait(lambda h: h["type"] == "wave" and h["event"] == event
                         and (wave is None or h["wave"] == wave), timeout_s)

    def wait_finished(self, rids: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(r in self.finished for r in rids):
            assert time.monotonic() < deadline, f"unfinished: {set(rids) - set(self.finished)}"
            self._pump(50)

    def close(self) -> None:
        self.inp.close(0)
        self.out.close(0)


def rank_args(rank: int, port: int) -> list[str]:
    # With --dp-rank, `vconsole engine` runs that one rank in this process (not the launcher).
    return ["--no-supervisor", "--model", "tiny", "--num-kv-blocks", "64",
            "--block-size", "8", "--max-num-seqs", "16", "--data-parallel-size", "2",
            "--dp-rank", str(rank), "--dp-master-port", str(port),
            "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.25",
            "--set", "dp_group_timeout_s=20", "--set", f"engine_id=rank-{rank}"]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    master = store_master()
    procs: list[EngineProcess] = []
    telemetry: list[Telemetry] = []
    links: list[Link] = []
    try:
        for r in range(2):   # from this thread: a child gets SIGTERM when its starter exits
            folder = tmp_path_factory.mktemp(f"rank{r}")
            procs.append(EngineProcess(rank_args(r, master.port),
                                       endpoints=ipc_endpoints(folder),
                                       log_path=folder / "engine.log",
                                       env={"OMP_NUM_THREADS": "1"}).start())
            telemetry.append(Telemetry(procs[-1].endpoints["telemetry"]))
            links.append(Link(procs[-1].endpoints))
        yield master, procs, links, telemetry
    finally:
        for x in (*links, *telemetry):
            x.close()
        for p in procs:
            p.stop()


def latest_dp(telemetry: Telemetry) -> dict[str, Any]:
    return telemetry.topic("dp")[-1]


@pytest.mark.proc
@pytest.mark.slow
def test_ranks_publish_their_ready_record_and_form_the_group_on_regroup(group):
    master, procs, links, telemetry = group
    for r, (p, link) in enumerate(zip(procs, links, strict=True)):
        record = read_rank(master, r, 5.0)
        assert record["pid"] == p.pid and record["endpoints"] == p.endpoints
        assert (record["dp_rank"], record["data_parallel_size"]) == (r, 2)
        assert (link.ready["dp_rank"], link.ready["data_parallel_size"]) == (r, 2)
    for link in links:
        link.send(protocol.encode_regroup(0))
    for r, t in enumerate(telemetry):
        dp = t.wait_for("dp", lambda b: b["group_state"] == "ok", timeout_s=60)
        assert (dp["rank"], dp["world_size"], dp["group_generation"], dp["wave"]) == (r, 2, 0, 0)


@pytest.mark.proc
@pytest.mark.slow
def test_a_wave_on_rank_0_runs_dummy_steps_on_rank_1_and_completes_on_both(group):
    _, _, (r0, r1), (t0, t1) = group
    rids = [f"a{i}" for i in range(len(WORK))]
    for rid, (ids, n) in zip(rids, WORK, strict=True):
        r0.add(rid, ids, n)
    start = r0.wave_event("start")
    assert start["wave"] == 0
    r1.send(protocol.encode_start_wave(start["wave"]))      # what the front end does
    r0.wait_finished(rids)
    done0, done1 = r0.wave_event("complete"), r1.wave_event("complete")
    assert done0["wave"] == done1["wave"] == 0
    assert [r0.tokens[r] for r in rids] == reference_outputs(WORK)
    assert not r1.finished                                   # rank 1 had no request
    dp1 = t1.wait_for("dp", lambda b: b["wave"] == 1 and not b["wave_running"])
    assert dp1["dummy_steps_total"] > 0 and dp1["sync_count_total"] > 0
    dp0 = t0.wait_for("dp", lambda b: b["wave"] == 1 and not b["wave_running"])
    assert dp0["sync_count_total"] == dp1["sync_count_total"]   # lockstep
    assert dp0["steps_total"] == dp1["steps_total"]
    for t in (t0, t1):
        t.wait_for("wave", lambda b: b["event"] == "complete" and b["wave"] == 0)


@pytest.mark.proc
@pytest.mark.slow
def test_a_later_request_starts_the_next_wave(group):
    _, _, (r0, r1), _ = group
    r0.add("b0", *WORK[1])
    start = r0.wave_event("start", wave=1)
    r1.send(protocol.encode_start_wave(start["wave"]))
    r1.send(protocol.encode_start_wave(0))                   # stale: ignored
    r0.wait_finished(["b0"])
    assert r0.wave_event("complete", 1)["wave"] == r1.wave_event("complete", 1)["wave"]
    assert r0.tokens["b0"] == reference_outputs([WORK[1]])[0]


@pytest.mark.proc
@pytest.mark.slow
def test_when_rank_1_dies_rank_0_goes_uncoordinated_and_still_serves(group):
    _, procs, (r0, _), (t0, _) = group
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].child.wait(10)
    rids = [f"c{i}" for i in range(len(WORK))]
    for rid, (ids, n) in zip(rids, WORK, strict=True):
        r0.add(rid, ids, n)
    assert r0.wave_event("start", wave=2)["wave"] == 2      # nobody to forward it to
    r0.wait_finished(rids)
    assert [r0.tokens[r] for r in rids] == reference_outputs(WORK)
    assert all(r0.finished[r].finish_reason == "length" for r in rids)
    t0.wait_for("dp", lambda b: b["group_state"] == "broken" and not b["wave_running"])
    r0.add("c-after", *WORK[0])                              # uncoordinated: no wave at all
    r0.wait_finished(["c-after"])
    assert not any(h["type"] == "wave" and h["wave"] > 2 for h in r0.headers)


@pytest.mark.proc
def test_an_unreachable_store_stops_the_rank_with_cannot_start(tmp_path):
    args = rank_args(0, 1)
    args[args.index("dp_group_timeout_s=20")] = "dp_group_timeout_s=1"
    p = EngineProcess(args, endpoints=ipc_endpoints(tmp_path), log_path=tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited with code 2"):
        p.start(timeout_s=60)
    assert "cannot reach the data-parallel store at 127.0.0.1:1" in p.log_text()
