"""Profile on demand against a live engine: `profile_start` / `profile_status` / `profile_cancel`
over the control socket of a real `vconsole engine`, under load from `EngineClient` threads.

One engine serves the module (tests run in file order). The phase shares are checked against
the engine's own ``step`` telemetry over the same steps: the subscriber connects before the
engine's first step and checks that it lost no ``step`` message, so summing each window's
``steps`` numbers every step, and the profile's ``first_step`` / ``last_step`` say which
windows lie inside it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry import schema
from vconsole.wire.control import PROFILE_MAX_STEPS, ControlError
from vconsole.wire.control_client import ControlClient, NotAuthorised

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
               "--set", "telemetry_hz=20"]
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(10 + i)] for i in range(12)]
MAX_TOKENS = 24
PHASES = ("schedule", "execute", "update", "structured")
EPS_S = 1e-6      # float rounding of sums of nanoseconds / 1e9; far below one step's phases


class StepTelemetry:
    """Every ``step`` and ``health`` message, decoded, in arrival order, from a SUB thread."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        for topic in (b"step", b"health"):
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        while not self._stop.is_set():
            if sock.poll(50):
                msg = schema.decode(sock.recv_multipart())
                self.messages.append((msg.topic, dict(msg.payload)))
        sock.close(0)

    def topic(self, name: str) -> list[dict[str, Any]]:
        return [p for t, p in list(self.messages) if t == name]

    def windows(self) -> list[tuple[int, int, dict[str, float]]]:
        """``(steps before, steps after, phase_s)`` per step window: cumulative step numbers,
        valid because no step ran before the subscriber was connected (see `engine_idle`)."""
        msgs = self.topic("step")
        seqs = [m["seq"] for m in msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a step message was lost"
        out, done = [], 0
        for m in msgs:
            out.append((done, done + m["steps"], m["phase_s"]))
            done += m["steps"]
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    eps = {n: f"ipc://{d}/{n}" for n in ("input", "output", "telemetry", "control")}
    with EngineProcess(ENGINE_ARGS, endpoints=eps, log_path=d / "engine.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def telemetry(engine):
    tel = StepTelemetry(engine.endpoints["telemetry"])
    deadline = time.monotonic() + 30
    while not any(h["steps"] == 0 for h in tel.topic("health")):   # connected, nothing ran
        assert time.monotonic() < deadline, "no health message from the idle engine"
        time.sleep(0.05)
    yield tel
    tel.close()


def control(engine, *, key: bool = True) -> ControlClient:
    return ControlClient(engine.endpoints["control"], timeout_s=30,
                         key=engine.control_key() if key else None)


def generate_all(client: EngineClient) -> list[list[int]]:
    ids = [client.submit(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0)
           for p in PROMPTS]
    done = client.gather(ids, timeout_s=120)
    assert all(done[i].finish_reason in ("length", "stop") and not done[i].error for i in ids)
    return [done[i].output_token_ids for i in ids]


def wait_done(ctl: ControlClient, pid: str, timeout_s: float = 180) -> tuple[dict, list[int]]:
    progress = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = ctl.profile_status(pid)
        progress.append(status["steps_done"])
        if status["state"] != "running":
            return status, progress
        time.sleep(0.05)
    raise AssertionError(f"profile {pid} not done within {timeout_s} s: {status}")


def test_profile_start_without_the_key_is_refused_and_profiles_nothing(engine, telemetry):
    with control(engine, key=False) as ctl:
        with pytest.raises(NotAuthorised, match="control key"):
            ctl.profile_start(5)
        ctl.key = "0" * 64
        with pytest.raises(NotAuthorised):
            ctl.profile_start(5)
        with pytest.raises(ControlError, match="no profile 'p1'"):
            ctl.profile_status("p1")       # nothing was armed
    assert "profiling the next" not in engine.log_path.read_text()


def test_malformed_profile_requests_are_answered_with_the_reason(engine):
    with control(engine) as ctl:
        for steps in (0, PROFILE_MAX_STEPS + 1, "20", True):
            reply = ctl.request("profile_start", fields={"steps": steps})
            assert not reply["ok"]
            assert f"an integer from 1 to {PROFILE_MAX_STEPS}" in reply["error"]
        reply = ctl.request("profile_status")
        assert not reply["ok"] and "needs 'profile'" in reply["error"]
        with pytest.raises(ControlError, match="no profile 'p99'"):
            ctl.profile_status("p99")


def test_a_profile_of_20_steps_under_load(engine, telemetry):
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
        baseline = generate_all(client)

    profiled = threading.Event()
    rounds: list[list[list[int]]] = []
    load_errors: list[BaseException] = []

    def load() -> None:
        try:
            with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
                while not profiled.is_set() or not rounds:
                    rounds.append(generate_all(c))
        except BaseException as e:  # reported by the test thread
            load_errors.append(e)
            profiled.set()

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    with control(engine) as ctl:
        while not telemetry.windows()[-1][1] and not load_errors:   # wait for the load
            time.sleep(0.01)
        started = ctl.profile_start(20)
        assert started["state"] == "running" and started["profiling"] is True
        assert started["steps"] == 20 and "slower" in started["slowdown_note"]
        with pytest.raises(ControlError, match=f"profile {started['id']} is running"):
            ctl.profile_start(5)
        status, progress = wait_done(ctl, started["id"])
    profiled.set()
    thread.join(240)
    assert not load_errors, load_errors

    # The engine kept serving, and profiling changed no token.
    assert rounds and all(r == baseline for r in rounds)

    assert status["state"] == "done" and status["profiling"] is False, status
    assert progress == sorted(progress) and progress[-1] == 20
    result = status["result"]
    assert result["id"] == started["id"] and result["steps"] == 20
    assert result["last_step"] - result["first_step"] == 20
    assert result["wall_s"] > 0 and result["slowdown_note"]

    ops = result["ops"]
    assert 0 < len(ops) <= 20
    assert all(set(op) == {"name", "self_cpu_s", "self_cuda_s", "calls"} for op in ops)
    key = result["sort_by"]
    assert [op[key] for op in ops] == sorted((op[key] for op in ops), reverse=True)
    # The model's matmuls: aten's, or oneDNN's on CPU (engine/worker/cpu_linear.py).
    assert any(op["name"] in ("aten::mm", "aten::addmm", "aten::linear",
                              "mkldnn::_linear_pointwise") for op in ops)

    shares = result["phases"]
    assert set(shares) == set(PHASES)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert {"attention", "mlp", "norm", "embedding", "lm_head", "sampler"} <= set(
        result["layers"])
    assert result["layers"]["attention"] > 0 and result["layers"]["mlp"] > 0

    # The same steps as the step topic saw them. Windows wholly inside the profiled steps
    # (first_step, last_step] hold a subset of its steps, windows that overlap them a superset,
    # so each phase's seconds are bracketed exactly (up to float rounding).
    first, last = result["first_step"], result["last_step"]
    deadline = time.monotonic() + 10
    while telemetry.windows()[-1][1] < last:
        assert time.monotonic() < deadline, "the step topic never covered the profile"
        time.sleep(0.05)
    windows = telemetry.windows()
    inside = [w for w in windows if first <= w[0] and w[1] <= last and w[1] > w[0]]
    overlap = [w for w in windows if w[1] > first and w[0] < last]
    for phase in PHASES:
        lo = sum(w[2][phase] for w in inside)
        hi = sum(w[2][phase] for w in overlap)
        assert lo - EPS_S <= result["phase_s"][phase] <= hi + EPS_S, (phase, lo, hi)
    # Shares: the overlapping windows are the profiled steps plus a few unprofiled ones at
    # each end, a fraction ``extra`` of their time. Mixing in a fraction w of other steps moves
    # every share by at most w, so that is the tolerance (plus float rounding); it is the
    # telemetry's coarseness (window edges), not the profiler's noise.
    total_hi = sum(sum(w[2].values()) for w in overlap)
    extra = 1.0 - sum(result["phase_s"].values()) / total_hi
    for phase in PHASES:
        seen = sum(w[2][phase] for w in overlap) / total_hi
        assert abs(seen - shares[phase]) <= extra + 1e-9, (phase, seen, shares[phase], extra)
    log = engine.log_path.read_text()
    assert f"profile {started['id']}: profiling the next 20 steps" in log
    assert f"profile {started['id']} done: 20 steps" in log


def test_one_profile_at_a_time_and_cancel(engine):
    with control(engine) as ctl:
        armed = ctl.profile_start(PROFILE_MAX_STEPS)      # an idle engine: no step runs
        assert armed["state"] == "running" and armed["steps_done"] == 0
        with pytest.raises(ControlError, match="is running .0/200 steps done"):
            ctl.profile_start(10)
        with control(engine, key=False) as reader:
            assert reader.profile_status(armed["id"])["state"] == "running"   # status is open
            with pytest.raises(NotAuthorised):
                reader.profile_cancel(armed["id"])
        cancelled = ctl.profile_cancel(armed["id"])
        assert cancelled["state"] == "cancelled" and cancelled["result"] is None
        assert cancelled["profiling"] is False
        again = ctl.profile_start(10)
        assert again["id"] != armed["id"]
        assert ctl.profile_cancel(again["id"])["state"] == "cancelled"
        assert ctl.profile_status(armed["id"])["state"] == "cancelled"


def test_the_console_link_speaks_the_profile_ops(engine):
    from vconsole.console.control_link import ControlLink

    # A stale key is read again from the key file and the start retried, as for set_config.
    link = ControlLink(engine.endpoints["control"], timeout_s=30, key="0" * 64,
                       key_file=engine.control_key_file)
    started = link.profile_start(5)
    assert started["state"] == "running" and link.key == engine.control_key()
    assert link.profile_status(started["id"])["steps"] == 5
    assert link.profile_cancel(started["id"])["state"] == "cancelled"
