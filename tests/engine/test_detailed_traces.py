"""``collect_detailed_traces`` (vLLM's --collect-detailed-traces): each request's final output
carries the summed schedule, model forward and model execute time of the steps it ran in
(``timings``: ``scheduler_s``, ``forward_s``, ``execute_s``; the OTLP span's
``gen_ai.latency.time_in_scheduler`` / ``time_in_model_forward`` / ``time_in_model_execute``).

A real engine core on the CPU, real steps. The sums are checked against the steps' own
`StepStats` (the same clock reads), so the figures are exact, not approximate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vconsole.engine.core import EngineCore
from vconsole.shared.config import EngineConfig
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams

DETAILED = ("scheduler_s", "forward_s", "execute_s")


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    c = EngineCore(EngineConfig(model="tiny", device="cpu", num_kv_blocks=32, block_size=8,
                                max_num_batched_tokens=16))
    yield c
    c.close()


def run(core: EngineCore, prompts: dict[str, int]) -> tuple[dict[str, RequestOutput],
                                                            dict[str, list[tuple[int, int]]]]:
    """Every request to its end; the final outputs and, per request, the (schedule, execute) ns
    of each step that scheduled it."""
    for rid, n in prompts.items():
        core.add_request(core.make_request(rid, prompt_token_ids=[7] * n, sampling=SamplingParams(
            max_tokens=4, ignore_eos=True)))
    final: dict[str, RequestOutput] = {}
    steps: dict[str, list[tuple[int, int]]] = {rid: [] for rid in prompts}
    while core.has_unfinished_requests():
        before = {rid: r.num_computed_tokens for rid in prompts
                  if (r := core.scheduler.get_request(rid)) is not None}
        outputs, _ = core.step()
        st = core.last_step
        assert st is not None
        for rid, computed in before.items():   # it ran: its computed tokens moved, or it left
            r = core.scheduler.get_request(rid)
            if r is None or r.num_computed_tokens > computed:
                steps[rid].append((st.schedule_ns, st.execute_ns))
        for outs in outputs.values():
            for out in outs:
                if out.finished:
                    final[out.request_id] = out
    return final, steps


def test_each_request_gets_the_sum_of_the_steps_it_ran_in(core: EngineCore) -> None:
    assert core.apply_config({"collect_detailed_traces": True}).applied
    try:
        # 20 prompt tokens at a budget of 16: "long" prefills over two steps, "short" waits
        # for the budget in the first and is scheduled from the second
        final, steps = run(core, {"long": 20, "short": 5})
    finally:
        core.apply_config({"collect_detailed_traces": False})
    for rid in ("long", "short"):
        t = final[rid].timings
        assert t is not None and set(DETAILED) <= set(t)
        assert t["scheduler_s"] == pytest.approx(sum(s for s, _ in steps[rid]) / 1e9, rel=1e-12)
        assert t["execute_s"] == pytest.approx(sum(e for _, e in steps[rid]) / 1e9, rel=1e-12)
        assert 0 < t["forward_s"] <= t["execute_s"]
    assert len(steps["long"]) == 2 + 3       # two prefill chunks, then 3 more tokens
    assert len(steps["short"]) == 1 + 3      # not in the first step: the budget was spent


def test_off_the_timings_have_none_of_them(core: EngineCore) -> None:
    final, _ = run(core, {"plain": 6})
    t = final["plain"].timings
    assert t is not None and "inference_s" in t and not set(DETAILED) & set(t)
    assert core.runner.time_forward is False
