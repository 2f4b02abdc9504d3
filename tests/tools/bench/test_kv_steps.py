"""The paired decode-step bench (issue #48): every format's engine steps its rows in turn, and
each median is given against auto's from the same run."""

from __future__ import annotations

import pytest

from vconsole.tools.bench.kv_steps import kv_steps_bench


def test_formats_are_stepped_in_turn_and_compared_with_auto_of_the_same_run() -> None:
    out = kv_steps_bench("tiny", rows=2, prompt_tokens=20, steps=2,
                         formats=("auto", "int4_kivi"))
    assert out["benchmark"] == "kv-steps" and out["rows"] == 2 and out["steps"] == 2
    auto, kivi = out["formats"]["auto"], out["formats"]["int4_kivi"]
    assert auto["vs_auto"] == 1.0 and auto["blocks"] == kivi["blocks"]   # the same batch
    assert 0 < kivi["decode_step_ms_min"] <= kivi["decode_step_ms_median"]
    assert kivi["vs_auto"] == pytest.approx(
        kivi["decode_step_ms_median"] / auto["decode_step_ms_median"])


def test_the_first_format_must_be_auto() -> None:
    with pytest.raises(ValueError, match="auto"):
        kv_steps_bench("tiny", rows=1, prompt_tokens=4, steps=1, formats=("int8_kivi",))
