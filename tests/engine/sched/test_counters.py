"""The scheduler's cumulative token counters, the figures behind vLLM's ``vllm:prompt_tokens`` and
``vllm:generation_tokens``: every sampled token counts once as generated; a request's whole
prompt counts once, when its first token is sampled.

The scheduler is driven directly, with a stand-in model that samples a token for every request
whose chunk reaches its last token (as the real runner does); what the counters say is checked
against the outputs the scheduler hands out.
"""

from __future__ import annotations

from support.scheduling import make_request, make_scheduler
from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.wire.outputs import RequestOutput

EOS = 2


def sample(sched: Scheduler, so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Token ``token`` for every request whose scheduled chunk ends at its last token."""
    starts = so.start_positions()
    sampled = {}
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.get_request(rid)
        if req is not None and starts[rid] + n == req.num_tokens:
            sampled[rid] = token
    return ModelRunnerOutput(sampled=sampled)


def step(sched: Scheduler, token: int = 7) -> list[RequestOutput]:
    so = sched.schedule()
    return [out for _, out in sched.update_from_output(so, sample(sched, so, token))]


def run_to_end(sched: Scheduler, outputs: list[RequestOutput], max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_requests():
            return
        outputs.extend(step(sched))
    raise AssertionError("the scheduler did not drain")


def generated(outputs: list[RequestOutput]) -> int:
    return sum(len(o.new_token_ids) for o in outputs)


def test_a_fresh_scheduler_reports_zero_for_both_counters():
    stats = make_scheduler().stats(max_rows=0)
    assert stats.num_prompt_tokens_total == 0 and stats.num_generation_tokens_total == 0


def test_each_sampled_token_counts_once_and_each_prompt_once_at_its_first_token():
    sched = make_scheduler(num_blocks=64)
    sched.add_request(make_request("a", 5, max_tokens=3))
    sched.add_request(make_request("b", 9, max_tokens=1))
    outputs = step(sched)  # both prompts fit in one step: each samples its first token
    assert sched.num_prompt_tokens_total == 5 + 9
    assert sched.num_generation_tokens_total == 2 == generated(outputs)
    run_to_end(sched, outputs)
    assert sched.num_prompt_tokens_total == 14  # decodes add no prompt tokens
    assert sched.num_generation_tokens_total == 3 + 1 == generated(outputs)


def test_a_chunked_prompt_counts_when_its_last_chunk_samples_not_per_chunk():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    sched.add_request(make_request("long", 20, max_tokens=2))
    step(sched)
    step(sched)  # 16 of 20 prompt tokens computed, nothing sampled yet
    assert sched.num_prompt_tokens_total == 0 and sched.num_generation_tokens_total == 0
    outputs = step(sched)
    assert sched.num_prompt_tokens_total == 20 and generated(outputs) == 1
    run_to_end(sched, outputs)
    assert sched.num_prompt_tokens_total == 20 and sched.num_generation_tokens_total == 2


def test_a_request_finished_before_its_first_token_adds_no_prompt_tokens():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    sched.add_request(make_request("runs", 4, max_tokens=5))
    sched.add_request(make_request("queued", 6, max_tokens=5))
    outputs = step(sched)
    sched.abort_requests(["queued"])  # never admitted
    run_to_end(sched, outputs)
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["queued"].finish_reason == "abort"
    assert sched.num_prompt_tokens_total == 4
    assert sched.num_generation_tokens_total == 5 == generated(outputs)


def test_tokens_of_a_request_aborted_mid_decode_stay_counted():
    sched = make_scheduler(num_blocks=64)
    sched.add_request(make_request("x", 3, max_tokens=50))
    outputs = step(sched) + step(sched) + step(sched)
    sched.abort_requests("x")
    run_to_end(sched, outputs)
    assert sched.num_prompt_tokens_total == 3
    assert sched.num_generation_tokens_total == 3 == generated(outputs)


def test_a_stop_token_is_a_generated_token():
    sched = make_scheduler(num_blocks=64)
    sched.add_request(make_request("s", 4, max_tokens=10, eos=EOS))
    outputs = step(sched, token=EOS)
    assert outputs[0].finish_reason == "stop"
    assert sched.num_generation_tokens_total == 1 and sched.num_prompt_tokens_total == 4


def test_recomputing_a_preempted_request_counts_its_prompt_only_once():
    # 4 blocks of 4 slots: two requests of 6 prompt + 6 outputs need 3 blocks each, so the
    # second one is preempted (recompute) while both decode, and runs again later.
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("p", 6, max_tokens=6))
    sched.add_request(make_request("q", 6, max_tokens=6))
    outputs: list[RequestOutput] = []
    run_to_end(sched, outputs)
    assert sched.num_preemptions_total >= 1
    assert sched.num_prompt_tokens_total == 12
    assert sched.num_generation_tokens_total == 12 == generated(outputs)


def test_a_prefix_cache_hit_still_counts_the_whole_prompt():
    sched = make_scheduler(num_blocks=64)
    shared = list(range(100, 112))
    sched.add_request(make_request("first", shared, max_tokens=1))
    outputs = step(sched)
    sched.add_request(make_request("second", [*shared, 500], max_tokens=1))
    outputs += step(sched)
    second = next(o for o in outputs if o.request_id == "second")
    assert second.num_cached_tokens > 0
    assert sched.num_prompt_tokens_total == 12 + 13


def test_stats_carry_both_counters():
    sched = make_scheduler(num_blocks=64)
    sched.add_request(make_request("a", 5, max_tokens=2))
    run_to_end(sched, [])
    stats = sched.stats(max_rows=0)
    assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (5, 2)
