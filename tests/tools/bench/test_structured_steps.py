"""`bench structured`'s reading of the engine's step records, on steps built by hand: a run's
steady decode steps and the phases the trace adds, and the stall probe's split of the busy
loop's steps into those that ran while a grammar compiled, its first masks, and the rest."""

from __future__ import annotations

from typing import Any

from vconsole.tools.bench.structured_probe import stall_figures
from vconsole.tools.bench.structured_steps import in_window, step_figures

STARTED = 1000.0


def _step(i: int, dur: float = 0.125, decode: int = 8, **extra: Any) -> dict[str, Any]:
    return {"kind": "step", "t": i * 0.25, "dur": dur, "prefill": extra.pop("prefill", 0),
            "decode": decode, "new_reqs": extra.pop("new_reqs", 0), **extra}


def test_step_figures_take_the_steady_decode_steps_and_any_phase_the_trace_adds() -> None:
    steps = [_step(0, dur=0.5, decode=2, prefill=64),            # a prefill: not steady
             _step(1, dur=0.25, decode=2),                       # under 3/4 of the widest
             *[_step(i, dur=0.125, decode=8, structured=0.025) for i in range(2, 6)]]
    out = step_figures(steps)
    assert out["steps"] == 6 and out["busy_s"] == 1.25
    assert out["steady_steps"] == 4 and out["steady_rows_median"] == 8
    assert out["steady_step_ms_median"] == 125.0
    assert out["structured_share_of_step"] == round(4 * 0.025 / 1.25, 4)
    assert step_figures([]) == {"steps": 0}


def test_in_window_keeps_the_steps_that_started_inside_it() -> None:
    steps = [_step(i) for i in range(8)]
    assert [s["t"] for s in in_window(steps, STARTED, STARTED + 0.5, STARTED + 1.0)] == \
        [0.5, 0.75, 1.0]


def test_a_compile_that_stretches_the_busy_loop_counts_against_the_steps_no_probe_touched():
    # The probe is sent at step 40 and finishes at step 52; its grammar compiles while steps
    # 40-44 run (each 4x the others), step 45 admits it, 46-52 run its first masks.
    steps = [_step(i) for i in range(100)]
    for i in range(40, 45):
        steps[i]["dur"] = 0.5
    steps[45].update(new_reqs=1, prefill=5)
    for i in range(46, 53):
        steps[i]["dur"] = 0.25
    marks = {"typical": [(STARTED + 10.0, STARTED + 13.0)]}
    out = stall_figures(steps, STARTED, marks, STARTED, STARTED + 99 * 0.25)
    assert out["background_rows"] == 8 and out["other_steps"] == 87
    assert out["other_ms"] == {"median": 125.0, "p90": 125.0, "max": 125.0}
    typical = out["typical"]
    assert typical["probes"] == 1
    assert typical["steps_while_compiling"] == 5 and typical["steps_first_masks"] == 7
    assert typical["while_compiling_ms"] == {"median": 500.0, "max": 500.0}
    assert typical["first_masks_ms"] == {"median": 250.0, "max": 250.0}
    assert typical["while_compiling_over_other_median"] == 4.0
    assert typical["while_compiling_over_other_p90"] == 5
    assert typical["while_compiling_over_other_max"] == 5
