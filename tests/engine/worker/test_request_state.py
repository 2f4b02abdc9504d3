"""The runner's copy of its requests, advanced only by the scheduler's plain data."""

import pytest

from vconsole.engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vconsole.engine.worker.request_state import RequestStates
from vconsole.wire.sampling import SamplingParams

SP = SamplingParams(max_tokens=8)


def new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0,
        outputs: list[int] | None = None) -> NewRequestData:
    return NewRequestData(rid, prompt, outputs or [], SP, blocks, computed)


def test_new_then_deltas_rebuild_the_request_and_say_when_to_sample():
    states = RequestStates()
    (seq,) = states.apply(SchedulerOutput(scheduled_new_reqs=[new("a", [1, 2, 3, 4, 5], [7])],
                                           num_scheduled_tokens={"a": 3}))
    assert (seq.start_pos, seq.token_ids, seq.do_sample) == (0, [1, 2, 3], False)
    cached = CachedRequestData()
    cached.append("a", [], [9], 3)
    (seq,) = states.apply(SchedulerOutput(scheduled_cached_reqs=cached,
                                           num_scheduled_tokens={"a": 2}))
    assert (seq.start_pos, seq.token_ids, seq.do_sample) == (3, [4, 5], True)
    assert seq.block_ids == [7, 9]
    cached = CachedRequestData()
    cached.append("a", [42], [], 5)
    (seq,) = states.apply(SchedulerOutput(scheduled_cached_reqs=cached,
                                           num_scheduled_tokens={"a": 1}))
    assert (seq.token_ids, seq.do_sample, seq.state.num_output_tokens) == ([42], True, 1)


def test_finished_and_preempted_requests_are_forgotten_before_new_ones_arrive():
    states = RequestStates()
    states.apply(SchedulerOutput(scheduled_new_reqs=[new("a", [1, 2], [0]), new("b", [3], [1])],
                                  num_scheduled_tokens={"a": 2, "b": 1}))
    # "a" is preempted and readmitted in one step (with its outputs to recompute); "b" finished.
    (seq,) = states.apply(SchedulerOutput(
        scheduled_new_reqs=[new("a", [1, 2], [5], outputs=[8])], preempted_req_ids=["a"],
        finished_req_ids={"b"}, num_scheduled_tokens={"a": 3}))
    assert set(states) == {"a"}
    assert (seq.token_ids, seq.block_ids, seq.do_sample) == ([1, 2, 8], [5], True)


def test_changes_for_a_request_the_runner_does_not_hold_are_refused():
    cached = CachedRequestData()
    cached.append("ghost", [1], [], 0)
    with pytest.raises(RuntimeError, match="ghost"):
        RequestStates().apply(SchedulerOutput(scheduled_cached_reqs=cached,
                                               num_scheduled_tokens={"ghost": 1}))
