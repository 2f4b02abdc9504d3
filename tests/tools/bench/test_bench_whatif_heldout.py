"""`vconsole bench whatif`'s held-out workload: the variants the issue names, and how each is
judged against its real replay (the replays themselves are the bench's, minutes long)."""

from __future__ import annotations

from typing import Any

from vconsole.telemetry.request_trace import StepRecord
from vconsole.tools.bench.whatif_heldout import (
    ENGINE,
    GOALS,
    judge,
    step_level,
    variants,
    within_spread,
)
from vconsole.whatif.cost_model import StepCostModel


def entry(tok: float, ttft: float, over: bool, near: bool = False) -> dict[str, Any]:
    pred = {"output_tok_s": tok, "ttft_p50_s": ttft, "itl_p50_s": 0.002, "ttft_p99_s": ttft * 2}
    return {"set": {"max_num_seqs": 6}, "predicted": pred,
            "interval": {"bounds": {k: [v * 0.9, v * 1.1] for k, v in pred.items()}},
            "overload": {"overloaded": over, "near_capacity": near, "capacity": {"req_s": 10.0},
                         "arrival_req_s": 12.0},
            "coverage": {"share": 0.0}}


REAL = {"output_tok_s": 1000.0, "ttft_p50_s": 1.0, "itl_p50_s": 0.002, "ttft_p99_s": 2.0}


def test_the_held_out_variants_cut_seats_to_a_fifth_halve_and_quarter_the_pool_and_overload():
    assert variants(ENGINE) == [{"max_num_seqs": 6}, {"num_kv_blocks": 96},
                                {"num_kv_blocks": 48}, {"max_num_seqs": 2}]


def test_a_variant_that_keeps_up_is_judged_by_the_goals_on_each_figure():
    close = judge(entry(1030.0, 1.05, False), entry(1200.0, 0.5, False), REAL,
                  {"grows": False, "rate": 0.0})
    assert close["within_goals"] and close["overload_right"]
    assert close["error"]["output_tok_s"] == 0.03
    assert close["error_uncalibrated"]["output_tok_s"] == 0.2
    assert close["in_interval"] == dict.fromkeys(GOALS, True)
    far = judge(entry(1060.0, 1.0, False), entry(1060.0, 1.0, False), REAL,
                {"grows": False, "rate": 0.0})
    assert not far["within_goals"]                      # 6% on tok/s: beyond 5%


def test_an_overloaded_variant_is_judged_by_its_verdict_against_the_real_queue():
    said = judge(entry(900.0, 9.0, True), entry(900.0, 9.0, True), REAL,
                 {"grows": True, "rate": 0.3})
    assert said["within_goals"]                        # its TTFT is not judged: it grows
    wrong = judge(entry(900.0, 9.0, True), entry(900.0, 9.0, True), REAL,
                  {"grows": False, "rate": 0.0})
    assert not wrong["within_goals"] and not wrong["overload_right"]
    missed = judge(entry(1000.0, 1.0, False), entry(1000.0, 1.0, False), REAL,
                   {"grows": True, "rate": 0.3})
    assert not missed["within_goals"]


def test_near_capacity_is_neither_verdict_and_is_judged_by_what_happened():
    grew = judge(entry(900.0, 9.0, False, near=True), entry(900.0, 9.0, False), REAL,
                 {"grows": True, "rate": 0.2})
    assert grew["near_capacity"] and grew["overload_right"] is None
    assert not grew["within_goals"]                  # a warning is not a detection
    kept_up = judge(entry(1300.0, 9.0, False, near=True), entry(900.0, 9.0, False), REAL,
                    {"grows": False, "rate": 0.0})
    assert kept_up["overload_right"] is None and not kept_up["within_goals"]   # 30% off
    close = judge(entry(1010.0, 1.02, False, near=True), entry(900.0, 9.0, False), REAL,
                  {"grows": False, "rate": 0.0})
    assert close["within_goals"]


def test_a_replay_s_level_is_its_steps_time_over_the_model_s_for_the_same_shapes():
    """The machine's speed during a run, against the model: steps that took 0.9 of the
    model's time (durations and the gaps between back-to-back steps) are at level 0.9;
    steps that computed nothing are left out."""
    model = StepCostModel({"const": 1e-3, "prefill": 2e-5, "decode": 1e-4, "context": 1e-7,
                           "prefill_attn": 0.0, "new_reqs": 2e-4},
                          {"const": 5e-5, "reqs": 1e-6}, num_steps=1)
    steps = []
    for i in range(50):
        pf, dec = (64 if i % 5 == 0 else 0), 1 + i % 7
        fitted = model.dur(pf, dec, 300 + 10 * i, 0, i % 2)
        dur = 0.9 * fitted
        steps.append(StepRecord(t=i * 0.01, dur=dur, execute=dur, prefill=pf, decode=dec,
                                reqs=dec + (pf > 0), running=dec, waiting=0,
                                context=300 + 10 * i, new_reqs=i % 2,
                                period=None if i % 3 == 0 else dur + 0.9 * model.gap(dec + (pf > 0))))
    steps.append(StepRecord(t=1.0, dur=5.0, execute=5.0, prefill=0, decode=0, reqs=0,
                            running=0, waiting=0))           # idle: not the model's
    assert abs(step_level(model, steps) - 0.9) < 1e-9
    assert step_level(model, steps[-1:]) is None


def test_the_baseline_is_within_the_engine_s_spread_when_no_larger_than_any_two_runs_differ():
    err = {"output_tok_s": 0.01, "ttft_p50_s": 0.12, "itl_p50_s": 0.05, "ttft_p99_s": None}
    replays = {"output_tok_s": 0.0, "ttft_p50_s": 0.02, "itl_p50_s": -0.06, "ttft_p99_s": 0.1}
    recorded = {"output_tok_s": -0.02, "ttft_p50_s": -0.15, "itl_p50_s": 0.01, "ttft_p99_s": 0.3}
    assert within_spread(err, replays, recorded) == {
        "output_tok_s": True, "ttft_p50_s": True, "itl_p50_s": True, "ttft_p99_s": None}
    assert within_spread(err, replays) == {
        "output_tok_s": False, "ttft_p50_s": False, "itl_p50_s": True, "ttft_p99_s": None}
