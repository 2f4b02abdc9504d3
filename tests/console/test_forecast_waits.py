"""A change's waits in the confirmation box: ``grows`` under overload, ``grows?`` near capacity
(where no interval bounds them), the ordinary interval otherwise (#44)."""

from __future__ import annotations

import pytest

from vconsole.console.forecast import box_markup
from vconsole.console.predictions import READY, Prediction
from vconsole.whatif.overload import wait_mark as mark_of

FIGS = {"output_tok_s": 900.0, "ttft_p99_s": 1.2, "itl_p99_s": 0.03, "preemptions": 0}


def prediction(overloaded: bool, near: bool) -> Prediction:
    verdict = {"overloaded": overloaded, "near_capacity": near, "arrival_req_s": 13.7,
               "capacity": {"req_s": 14.1, "output_tok_s": 1500.0}, "margin": 0.06}
    stated = {"output_tok_s": 0.031, "ttft_p99_s": 0.12, "itl_p99_s": 0.05, "preemptions": None}
    return Prediction(READY, change={"max_num_seqs": 6}, before=dict(FIGS), after=dict(FIGS),
                      live=dict(FIGS), before_info={"interval": {"stated": stated}},
                      after_info={"interval": {"stated": stated}, "overload": verdict})


def line(p: Prediction, label: str) -> str:
    return next(ln for ln in box_markup(p).splitlines() if ln.strip().startswith(label))


@pytest.mark.parametrize(("over", "near", "ttft", "wait_mark"), [
    (False, False, "±12%", ""), (False, True, "grows?", "grows?"),
    (True, False, "→ grows", "grows")])
def test_a_wait_reads_its_interval_or_that_the_queue_may_grow(over: bool, near: bool, ttft: str,
                                                              wait_mark: str) -> None:
    p = prediction(over, near)
    assert mark_of("ttft_p99_s", p.after_info["overload"]) == wait_mark
    assert mark_of("output_tok_s", p.after_info["overload"]) == ""    # throughput is no wait
    assert ttft in line(p, "TTFT p99")
    assert "±3.1%" in line(p, "output tok/s")         # its interval stands either way
    if near:
        assert "±12%" not in line(p, "TTFT p99")
        assert "near capacity: this change serves 14.1 req/s ±6.0%" in box_markup(p)


def test_an_overloaded_wait_has_no_interval_beside_grows() -> None:
    ttft = line(prediction(True, False), "TTFT p99")
    assert ttft.count("grows") == 1 and "±" not in ttft
