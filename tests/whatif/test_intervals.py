"""Honest uncertainty: each predicted figure carries an interval (the noise reseeded, the step
costs moved by their error at other batch shapes); the baseline's figures whose observed value
the interval misses are marked; the noise a short step gets is that of short steps."""

from __future__ import annotations

import numpy as np
import pytest
from test_calibration import busy_trace, decode_steps
from test_simulate import make_trace

from vconsole.whatif.cost_model import Noise, fit
from vconsole.whatif.intervals import interval, outside_interval, shape_error
from vconsole.whatif.predict import rough, whatif


def test_a_short_step_draws_the_stalls_of_short_steps_not_a_ratio_of_long_ones():
    fitted = np.concatenate([np.full(200, 0.001), np.full(200, 0.100)])
    resid = np.concatenate([np.full(200, 0.0005), np.full(200, 0.010)])
    draw = Noise.of(fitted, resid).sampler(seed=3)
    short = [draw(0.001) for _ in range(500)]
    long = [draw(0.1) for _ in range(500)]
    assert np.mean(short) == pytest.approx(0.0015, rel=0.01)     # +0.5 ms, not +10%
    assert np.mean(long) == pytest.approx(0.110, rel=0.01)
    assert draw(0.0002) == pytest.approx(0.0007)     # shorter than any: the nearest group's
    again = Noise.of(fitted, resid).sampler(seed=3)
    assert [again(0.001) for _ in range(500)] == short


def test_the_cost_model_s_error_beyond_its_shapes_is_measured_by_holding_shapes_out():
    linear = decode_steps(range(1, 17), 1200)
    err = shape_error(linear, fit(linear))
    assert err["inside"] < 0.02 and err["outside"] < 0.03      # linear: it extrapolates
    curved = decode_steps(range(1, 17), 1200)
    for s in curved:                                  # a cost the linear model cannot follow
        s.dur += 0.0004 * s.reqs * s.reqs
    err = shape_error(curved, fit(curved))
    assert err["outside"] > 0.1 and err["outside"] > 2 * err["inside"]


def test_an_interval_holds_its_center_and_every_run_and_states_the_half_width():
    center = {"output_tok_s": 100.0, "ttft_p50_s": 1.0, "preemptions": 0}
    runs = [{"output_tok_s": 96.0, "ttft_p50_s": 1.3, "preemptions": 2},
            {"output_tok_s": 102.0, "ttft_p50_s": 0.9, "preemptions": 0}]
    iv = interval(center, runs)
    assert iv["bounds"]["output_tok_s"] == [96.0, 102.0]
    assert iv["stated"]["output_tok_s"] == pytest.approx(0.04)
    assert iv["stated"]["ttft_p50_s"] == pytest.approx(0.3)
    assert iv["stated"]["preemptions"] is None                 # of 0: no relative width
    assert outside_interval({"output_tok_s": 101.0, "ttft_p50_s": 1.5},
                            iv["bounds"]) == ["ttft_p50_s"]


def test_each_prediction_carries_an_interval_and_rough_figures_are_judged_by_it():
    report = whatif(busy_trace(), [{"max_num_seqs": 4}])
    base = report["baseline"]
    for entry in (base, *report["variants"]):
        iv = entry["interval"]
        for k, b in iv["bounds"].items():
            if b is not None:
                assert b[0] <= entry["predicted"][k] <= b[1]
    assert report["model"]["shape_error"]["outside"] >= report["model"]["shape_error"]["inside"]
    assert base["rough"] == rough(base["error"], base["interval"]["stated"])
    # make_trace's recorded first tokens (0.1 s after each arrival) are far off any prediction
    assert "ttft_p50_s" in base["rough"]


def test_intervals_can_be_left_out():
    report = whatif(make_trace(), [{"max_num_seqs": 4}], intervals=False)
    assert "interval" not in report["baseline"] and "shape_error" not in report["model"]
    assert report["baseline"]["rough"] == rough(report["baseline"]["error"],
                                                report["model"]["rel_error"])
