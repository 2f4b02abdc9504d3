"""A model execution that raises fails that step's requests, and only those; the engine keeps
serving. After ``max_consecutive_step_failures`` failed steps in a row the engine process
drains and exits with its own code, for the supervisor to restart it.

The fault is the runner instance's ``execute_model`` replaced inside the test (monkeypatch):
nothing in the engine knows about fault injection.
"""

from __future__ import annotations

import threading

import pytest

from support.scheduling import make_request, make_scheduler
from vconsole.engine.client.client import EngineClient
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.process.core_proc import EngineCoreProc
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.shared.config import EngineConfig
from vconsole.wire import exit_codes
from vconsole.wire.sampling import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [20, 21, 22], "c": [40, 41, 42, 43, 44, 45, 46]}
MAX_TOKENS = 6


class InjectedFault(RuntimeError):
    pass


def fail_calls(monkeypatch, runner, calls: set[int]) -> list[set[str]]:
    """Make this runner's ``execute_model`` raise on the given calls (1-based), until the test
    ends; returns, per failed call, the ids that call scheduled."""
    real = runner.execute_model
    count = 0
    failed: list[set[str]] = []

    def execute_model(so):
        nonlocal count
        count += 1
        if count in calls:
            failed.append(set(so.num_scheduled_tokens))
            raise InjectedFault(f"device lost on call {count}")
        return real(so)

    monkeypatch.setattr(runner, "execute_model", execute_model)
    return failed


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, block_size=4,
                                   max_num_seqs=2))


def add(core: EngineCore, rid: str, prompt: list[int]) -> None:
    req = core.make_request(rid, prompt_token_ids=prompt,
                            sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                    ignore_eos=True))
    assert core.add_request(req) is None


def test_the_scheduler_fails_only_the_steps_requests_and_resends_what_to_forget():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for rid in ("r1", "r2", "r3"):
        sched.add_request(make_request(rid, 6, max_tokens=4))
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"r1", "r2"}      # r3 waits: two seats
    sched.update_from_output(first, ModelRunnerOutput({"r1": 1, "r2": 2}))
    sched.abort_requests("r2")
    failing = sched.schedule()
    assert failing.finished_req_ids == {"r2"}
    assert set(failing.num_scheduled_tokens) == {"r1", "r3"}

    sched.fail_step(failing, "InjectedFault: boom")
    outs = {req.request_id: out for req, out in
            sched.update_from_output(failing, ModelRunnerOutput())}
    assert outs["r1"].finish_reason == "error" and outs["r1"].error == "InjectedFault: boom"
    assert outs["r3"].finish_reason == "error" and outs["r3"].finished
    assert not sched.has_requests()
    # The runner may have raised before it read ``failing``: it is told again to forget r2,
    # and to forget the failed r1 and r3.
    assert sched.schedule().finished_req_ids == {"r1", "r2", "r3"}


@pytest.mark.slow
def test_a_failing_step_errors_its_requests_and_the_others_finish_with_greedy_output(
        core, monkeypatch):
    reference = run_batch(core, greedy_requests(core, list(PROMPTS.values()), MAX_TOKENS,
                                                ignore_eos=True))
    expected = dict(zip(PROMPTS, reference.output_token_ids, strict=True))
    assert all(len(t) == MAX_TOKENS for t in expected.values())

    failed = fail_calls(monkeypatch, core.runner, {3})   # a and b decode; c waits for a seat
    for rid, prompt in PROMPTS.items():
        add(core, rid, prompt)
    finals: dict[str, object] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    failing_step_finals: set[str] | None = None
    while core.has_unfinished_requests():
        outputs, _ = core.step()
        done_now = set()
        for outs in outputs.values():
            for out in outs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out
                    done_now.add(out.request_id)
        if failed and failing_step_finals is None:
            failing_step_finals = done_now
            assert core.consecutive_step_failures == 1
    assert failed == [{"a", "b"}]
    assert failing_step_finals == {"a", "b"}, "the failed step reports its own requests"
    for rid in ("a", "b"):
        assert finals[rid].finish_reason == "error"
        assert finals[rid].error == "InjectedFault: device lost on call 3"
        assert len(tokens[rid]) < MAX_TOKENS
    assert finals["c"].finish_reason == "length" and finals["c"].error is None
    assert tokens["c"] == expected["c"], "the request after the failure is still exact"
    assert core.consecutive_step_failures == 0, "a good step resets the count"
    assert not {"a", "b"} & set(core.runner.requests), "the runner forgot the failed requests"


@pytest.mark.proc
@pytest.mark.slow
def test_an_engine_whose_steps_keep_failing_drains_and_exits_with_its_own_code(
        core, tmp_path, monkeypatch):
    """Real sockets (ipc://) and the real busy loop, in this process: two failed steps in a
    row (the threshold set to 2) make the loop drain and end with exit code 3, every request
    answered."""
    assert core.apply_config({"max_consecutive_step_failures": 2, "max_num_seqs": 1}).ok
    fail_calls(monkeypatch, core.runner, set(range(1, 1000)))
    eps = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    proc = EngineCoreProc(core.config, eps, core=core,
                          control_key_file=str(tmp_path / "control.key"))
    proc.start()
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop")
    loop.start()
    try:
        with EngineClient(eps["input"], eps["output"], timeout_s=30) as client:
            first = client.gather([client.submit(prompt_token_ids=[5, 6, 7], max_tokens=4)],
                                  timeout_s=30)
            (done,) = first.values()
            assert done.finish_reason == "error" and "InjectedFault" in done.error
            assert loop.is_alive(), "one failure is not enough to stop"
            second = client.submit(prompt_token_ids=[8, 9], max_tokens=4)
            waiting = client.submit(prompt_token_ids=[10, 11], max_tokens=4)
            results = client.gather([second, waiting], timeout_s=30)
        assert results[second].finish_reason == "error"
        assert results[waiting].finished and results[waiting].finish_reason != "length"
        loop.join(30)
        assert not loop.is_alive()
        assert proc.exit_code == exit_codes.STEP_FAILURES
    finally:
        if loop.is_alive():
            proc.request_shutdown("test cleanup")
            loop.join(30)
        core.apply_config({"max_consecutive_step_failures": 3, "max_num_seqs": 2})
