"""Calibration and coverage: the grid of batch shapes `--calibrate` probes, the calibration's
steps brought to the trace's level and fitted with the trace's, and a prediction that leaves
the shapes its step-time model was fitted on saying so.

The traces are built by hand: a trace whose steps all ran 10-16 rows (a busy engine with many
seats), a variant that cuts the seats to 2 (steps the trace never ran), and a calibration that
ran the 2-row shapes."""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_simulate import make_trace  # the simulator's hand-built trace

from vconsole.commands.whatif import format_report
from vconsole.telemetry.request_trace import StepRecord, Trace, TraceHeader
from vconsole.whatif.calibration import (
    DECODE_STEPS,
    calibration_path,
    calibrations_dir,
    engine_config,
    fingerprint,
    grid,
    level_factor,
    leveled,
    newest,
    stored_trace_path,
)
from vconsole.whatif.coverage import Coverage, describe, shape
from vconsole.whatif.predict import whatif

CONFIG = {"max_num_seqs": 32, "max_num_batched_tokens": 256}


def decode_steps(rows: range, n: int, *, seed: int = 0, scale: float = 1.0,
                 ctx: tuple[int, int] = (64, 120), chunks: bool = False) -> list[StepRecord]:
    """``n`` decode-only steps of ``rows`` rows at ``ctx`` tokens of context each, timed by a
    per-step cost that a fit on many rows cannot separate from the per-row one; with
    ``chunks``, every other step also prefills a chunk of 4-255 tokens."""
    rng = random.Random(seed)
    steps, t = [], 0.0
    for i in range(n):
        r = rng.choice(list(rows))
        context = r * rng.randint(*ctx)
        pf = int(2 ** rng.uniform(2, 8)) if chunks and i % 2 else 0
        dur = scale * (0.004 + 0.0005 * r + 1e-7 * context + 2e-5 * pf) * (1 + rng.gauss(0, 0.01))
        steps.append(StepRecord(t=t, dur=dur, execute=dur, prefill=pf, decode=r,
                                reqs=r + (pf > 0), running=r, waiting=0, context=context,
                                period=dur + 0.0002))
        t += dur + 0.0002
    return steps


def busy_trace() -> Trace:
    trace = make_trace(rate=5.0)
    trace.steps = decode_steps(range(10, 17), 600)
    return trace


# --- the grid --------------------------------------------------------------------------------

def test_the_grid_probes_every_seat_count_the_variants_need_within_the_pool():
    probes = grid(CONFIG, 192, 16, 2048, [{"max_num_seqs": 6}, {"max_num_batched_tokens": 64}])
    rows = sorted({p.rows for p in probes})
    assert rows == [1, 2, 4, 6, 8, 16, 32]            # powers of two, and 6 (a fifth of 32)
    for p in probes:
        if p.output_len == DECODE_STEPS:              # a decode probe: its rows fit the pool
            assert p.rows * (p.prompt_len + DECODE_STEPS + 16) <= 192 * 16
    contexts = {p.prompt_len for p in probes if p.rows == 6 and p.output_len == DECODE_STEPS}
    assert len(contexts) >= 4                           # an octave of context per probe
    chunks = {p.prompt_len for p in probes if p.output_len == 1}
    assert {64, 256} <= chunks                          # each budget a variant or the trace runs
    cfg = engine_config({**CONFIG, "num_kv_blocks": 192}, 192, [{"num_kv_blocks": 400}])
    assert cfg["max_num_seqs"] == 32 and cfg["num_kv_blocks"] == 400


def test_the_calibration_is_kept_beside_the_trace(tmp_path):
    assert calibration_path(tmp_path / "t.jsonl") == tmp_path / "t.calib.jsonl"
    assert calibration_path("run.trace") == calibration_path("run.trace").with_name(
        "run.trace.calib.jsonl")


# --- coverage and the out-of-range warning ------------------------------------------------------

def test_shapes_are_named_in_rows_context_and_chunk():
    s = decode_steps(range(6, 7), 1)[0]
    assert describe(shape(s)).startswith("5-6 rows, 64-127 tokens of context each")
    assert describe(shape(s)).endswith("decode only")


def test_a_prediction_that_leaves_the_fitted_shapes_says_so():
    trace = busy_trace()
    cov = Coverage.of(trace.steps)
    assert cov.outside(trace.steps)["share"] == 0.0
    report = whatif(trace, [{"max_num_seqs": 2}], intervals=False)
    variant = report["variants"][0]
    assert variant["coverage"]["warn"] and variant["coverage"]["share"] > 0.5
    assert any(e.startswith("2 rows") for e in variant["coverage"]["examples"])
    text = format_report(report)
    assert "outside the fit:" in text and "max_num_seqs=2" in text and "--calibrate" in text


def test_a_calibration_of_those_shapes_covers_them_and_is_fitted_with_the_trace():
    trace = busy_trace()
    calib = Trace(trace.header, steps=decode_steps(range(1, 4), 1200, seed=2, ctx=(16, 250),
                                                    chunks=True))
    report = whatif(trace, [{"max_num_seqs": 2}], calibration=calib, intervals=False)
    assert report["model"]["calibrated"] and report["model"]["num_steps"] == 1800
    assert not report["variants"][0]["coverage"]["warn"]
    assert "outside the fit" not in format_report(report)


def test_a_calibration_of_another_model_is_refused():
    trace = busy_trace()
    calib = Trace(make_trace().header, steps=decode_steps(range(1, 3), 50))
    calib.header.model = "smollm2"
    with pytest.raises(ValueError, match="measured on 'smollm2'"):
        whatif(trace, [], calibration=calib)


def test_a_calibration_on_a_slower_machine_is_brought_to_the_trace_s_level():
    trace_steps = decode_steps(range(8, 13), 400)
    calib = decode_steps(range(1, 13), 400, seed=3, scale=2.0)     # every step twice as long
    assert level_factor(trace_steps, calib) == pytest.approx(0.5, rel=0.05)
    moved = leveled(trace_steps, calib)
    assert moved[0].dur == pytest.approx(calib[0].dur * level_factor(trace_steps, calib))
    # the same machine, other shapes: the level is the trace's already
    assert level_factor(trace_steps, decode_steps(range(1, 3), 100, seed=4)) == pytest.approx(
        1.0, rel=0.05)
    assert level_factor(trace_steps, decode_steps(range(1, 3), 5)) == 1.0   # too few to fit


def test_the_level_s_drift_widens_the_intervals():
    trace = busy_trace()
    same = Trace(trace.header, steps=decode_steps(range(1, 4), 600, seed=2, chunks=True))
    slow = Trace(trace.header, steps=decode_steps(range(1, 4), 600, seed=2, chunks=True,
                                                  scale=1.3))
    a = whatif(trace, [], calibration=same)["model"]
    b = whatif(trace, [], calibration=slow)["model"]
    assert a["calibration_level"] == pytest.approx(1.0, abs=0.05)
    assert b["calibration_level"] == pytest.approx(1 / 1.3, rel=0.05)
    assert b["shape_error"]["inside"] >= 0.2 > a["shape_error"]["inside"]


# --- the console's calibrations: kept by engine kind, the newest used ---------------------------

HEADER = TraceHeader(model="tiny", block_size=16, num_kv_blocks=192,
                     config={"device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto",
                             "block_size": 16, "max_num_seqs": 32})


def test_an_engine_s_fingerprint_ignores_the_seats_and_pool_but_not_its_cost_keys():
    same = dataclasses.replace(HEADER, num_kv_blocks=96,
                               config={**HEADER.config, "max_num_seqs": 6})
    assert fingerprint(same) == fingerprint(HEADER)
    for other in (dataclasses.replace(HEADER, model="smollm2"),
                  dataclasses.replace(HEADER, config={**HEADER.config, "kv_cache_dtype": "int8"}),
                  dataclasses.replace(HEADER, config={**HEADER.config, "dtype": "bfloat16"})):
        assert fingerprint(other) != fingerprint(HEADER)


def test_the_newest_calibration_of_an_engine_like_this_one_is_used(tmp_path):
    assert newest(HEADER, tmp_path) is None
    old = calibration_path(stored_trace_path(HEADER, tmp_path, now=1_800_000_000))
    new = calibration_path(stored_trace_path(HEADER, tmp_path, now=1_800_000_600))
    other = calibration_path(stored_trace_path(
        dataclasses.replace(HEADER, model="smollm2"), tmp_path, now=1_800_009_999))
    for p in (new, old, other):        # written newest first: the name's stamp decides
        p.write_text("")
    stored_trace_path(HEADER, tmp_path, now=1_800_009_999).write_text("")   # a trace, no calib
    assert newest(HEADER, tmp_path) == new
    assert new.name.endswith("-20270115T081000.calib.jsonl")


def test_the_calibrations_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VCONSOLE_CALIBRATIONS", raising=False)
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    assert calibrations_dir() == tmp_path / "calibrations"
    monkeypatch.setenv("VCONSOLE_CALIBRATIONS", str(tmp_path / "own"))
    assert calibrations_dir() == tmp_path / "own"


def test_a_calibration_of_another_step_regime_is_fitted_in_the_trace_s_and_said():
    # A trace from an engine that ran every step in Python (0 native rows), calibrated on an
    # engine that ran small decode steps natively: the calibration's steps are fitted as the
    # trace's engine runs them (no regime term), and the report says so.
    trace = busy_trace()
    calib = Trace(make_trace().header, steps=decode_steps(range(1, 3), 50))
    calib.header.native_decode_rows = 8
    for s in calib.steps:
        s.native = True
    model = whatif(trace, [], calibration=calib)["model"]
    assert model["native_rows"] == 0 and model["coef"]["python"] == 0.0
    assert any("up to 8 rows natively, the trace's up to 0" in n for n in model["notes"])
