"""What-if in the console, driven by Pilot at 80x24: the confirmation box of a config change
shows its predicted effect while the operator reads it, the Advice rows carry theirs, and the
What-if screen compares live | now | with the edits.

The engine's trace comes through the control channel's ``get_trace`` (here a `FakeControl`
that has one, `TracingControl`), the same call the live console makes; the trace itself is
made by the what-if simulator with a known step cost, so it is self-consistent and takes
milliseconds. The expected figures are computed by `WhatIf` directly on the same text.
(`tests/console/test_console_whatif_live.py` does the same against a real engine.)
"""

from __future__ import annotations

import json
import random
import threading
from functools import cache
from typing import Any

import pytest
from textual.widgets import Input, Static

from support.console_testing import FakeControl, replay_app, until
from support.synthetic import generate
from vconsole.console.calibrating import NO_CALIBRATION, pick
from vconsole.console.predictions import (
    NO_CHANNEL,
    READY,
    SHOWN,
    Prediction,
    TraceInfo,
    WhatIf,
    change_pct,
    figure,
)
from vconsole.console.screens.advice import AdviceScreen
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.whatif import WhatIfScreen
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.request_trace import (
    FIGURES,
    RequestRecord,
    Trace,
    TraceHeader,
    parse_lines,
    read_trace,
    trace_lines,
)
from vconsole.whatif.calibration import calibration_path, stored_trace_path
from vconsole.whatif.cost_model import StepCostModel
from vconsole.whatif.predict import pct, tolerance
from vconsole.whatif.simulate import simulate

pytestmark = pytest.mark.slow

BLOCKS, SEATS = 140, 32
CONFIG = EngineConfig(num_kv_blocks=BLOCKS, max_num_seqs=SEATS)
SLOW_SCHEDULER = {"duration_s": 20, "slow_window": (0, 2), "burst_window": (0, 0), "rate": 14}


@cache
def trace_text(n: int = 80, rate: float = 40.0, seed: int = 1) -> str:
    """``n`` requests at ``rate``/s served by an engine of `CONFIG` whose steps cost what the
    model below says: busy enough that max_num_seqs and the pool matter (it preempts)."""
    header = TraceHeader(model="tiny", block_size=CONFIG.block_size, num_kv_blocks=BLOCKS,
                         vocab_size=256, max_model_len=2048, config=CONFIG.to_dict())
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out = rng.randint(20, 80)
        reqs.append(RequestRecord(arrival=t, finish=t, prompt_len=rng.randint(32, 256),
                                  output_len=out, max_tokens=out, ignore_eos=True))
    cost = StepCostModel({"const": 0.004, "prefill": 2e-5, "decode": 4e-4, "context": 1e-7,
                          "prefill_attn": 0.0, "new_reqs": 2e-4},
                         {"const": 0.0005, "reqs": 1e-5}, 0)
    served = simulate(Trace(header, reqs), CONFIG, BLOCKS, cost, max_model_len=2048,
                      vocab_size=256)
    return "".join(trace_lines(Trace(header, served.requests, served.steps)))


@cache
def late_trace_text() -> str:
    """`trace_text` whose recorded first tokens (and finishes) came 0.5 s later than its steps
    make them: "now" misses live TTFT by far more than the step-time model's error (none
    here), as a trace recorded beside other work does; the gaps between tokens are the same."""
    out = []
    for line in trace_text().splitlines(keepends=True):
        rec = json.loads(line)
        if rec["kind"] == "request":
            rec["first_token"] += 0.5
            rec["finish"] += 0.5
            line = json.dumps(rec) + "\n"
        out.append(line)
    return "".join(out)


class TracingControl(FakeControl):
    """A fake engine that also hands out its trace; ``gate`` (when given) holds ``get_trace``
    until it is set, so a test sees what the console shows while it waits."""

    def __init__(self, text: str, config: EngineConfig | None = CONFIG,
                 gate: threading.Event | None = None) -> None:
        super().__init__(config)
        self.text = text
        self.gate = gate

    def get_trace(self, window_s: float | None = None) -> str:
        self.calls.append(("get_trace", None))
        if self.gate is not None:
            self.gate.wait(10)
        return self.text


def expected(change: dict[str, Any], text: str | None = None) -> Any:
    text = text or trace_text()
    (p,) = WhatIf(lambda: text).predict([change])
    assert p.ready, p.headline()
    return p


def text_of(widget: Static) -> str:
    return str(widget.render())


def sets(ctl: FakeControl) -> list[dict[str, Any]]:
    return [values for op, values in ctl.calls if op == "set_config"]


def traces(ctl: FakeControl) -> int:
    return sum(1 for op, _ in ctl.calls if op == "get_trace")


async def ask_change(pilot, app, key: str, value: str) -> ConfirmScreen:
    await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None)
    assert app.request_change(key, value) is None
    await pilot.pause()
    box = app.screen
    assert isinstance(box, ConfirmScreen)
    return box


def forecast(box: ConfirmScreen) -> str:
    return text_of(box.query_one("#confirm-forecast", Static))


# --- the confirmation box ----------------------------------------------------------------------

async def test_the_box_shows_predicting_at_once_then_before_and_after_for_max_num_seqs():
    ctl = TracingControl(trace_text(), gate=threading.Event())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "8")
        assert box.title_text == "Change max_num_seqs: 32 → 8?"
        assert "predicting…" in forecast(box)          # at once, before the trace came
        ctl.gate.set()
        await until(pilot, lambda: "predicted" in forecast(box))
        shown = forecast(box)
        want = expected({"max_num_seqs": 8})
        for key in SHOWN:
            line = next(ln for ln in shown.splitlines() if ln.strip().startswith(
                {"output_tok_s": "output tok/s", "ttft_p99_s": "TTFT p99",
                 "itl_p99_s": "ITL p99", "preemptions": "preemptions"}[key]))
            assert f"{figure(key, want.before[key])} → {figure(key, want.after[key])}" in line
            assert figure(key, want.live[key]) in line
        assert "80 requests over " in shown
        assert want.before["preemptions"] > want.after["preemptions"]    # the point of it
        # 80x24: the whole box, its buttons included, is on screen
        assert box.query_one("#confirm-box").region.bottom <= 24
        assert box.query_one("#confirm").region.bottom <= 24
        await pilot.press("escape")
    assert sets(ctl) == [] and traces(ctl) == 1


async def test_the_box_marks_a_figure_the_model_misses_on_the_live_traffic():
    ctl = TracingControl(late_trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "8")
        await until(pilot, lambda: "predicted" in forecast(box))
        shown = forecast(box)
        want = expected({"max_num_seqs": 8}, late_trace_text())
        assert "ttft_p99_s" in want.rough and "itl_p99_s" not in want.rough
        ttft = next(ln for ln in shown.splitlines() if ln.strip().startswith("TTFT p99"))
        itl = next(ln for ln in shown.splitlines() if ln.strip().startswith("ITL p99"))
        assert f"{figure('ttft_p99_s', want.after['ttft_p99_s'])} !" in ttft and "!" not in itl
        assert f"! {want.rough_line()}" in " ".join(shown.split())
        assert box.query_one("#confirm").region.bottom <= 24
        await pilot.press("escape")


async def test_the_box_says_overloaded_first_with_the_capacity_and_an_interval_per_figure():
    text = trace_text(n=170, rate=14.0)              # 12 s of arrivals, 32 seats keep up
    ctl = TracingControl(text)
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "1")
        await until(pilot, lambda: "predicted" in forecast(box), timeout=60)
        shown = forecast(box)
        want = expected({"max_num_seqs": 1}, text)
        assert want.overloaded and not expected({}, text).overloaded
        cap = want.after_info["overload"]["capacity"]["req_s"]
        lines = [ln.strip() for ln in shown.splitlines()]
        assert lines[1].startswith(f"overloaded: this change serves {cap:,.1f} req/s")
        flat = " ".join(shown.split())
        assert "the queue grows without bound at this rate" in flat
        ttft = next(ln for ln in lines if ln.startswith("TTFT p99"))
        assert "→ grows" in ttft                    # not a figure of the trace's length
        tok = next(ln for ln in lines if ln.startswith("output tok/s"))
        assert tolerance(want.after_stated["output_tok_s"]) in tok
        assert box.query_one("#confirm").region.bottom <= 24
        await pilot.press("escape")
    assert sets(ctl) == []


async def test_a_routine_change_of_a_modelled_key_is_confirmed_and_never_waits_for_the_prediction():
    ctl = TracingControl(trace_text(), gate=threading.Event())   # the trace never comes
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "40")
        assert "Applied between two steps" in text_of(box.query_one("#confirm-text", Static))
        assert "predicting…" in forecast(box)
        await pilot.press("tab", "enter")                   # "Apply change", at once
        await until(pilot, lambda: app.steering.replies.get("max_num_seqs") is not None
                    and app.steering.replies["max_num_seqs"].done)
        assert sets(ctl) == [{"max_num_seqs": 40}]
        ctl.gate.set()
        await pilot.pause(0.2)                              # the late answer goes nowhere
        assert not isinstance(app.screen, ConfirmScreen)


async def test_too_little_traffic_is_said_with_the_reason():
    ctl = TracingControl(trace_text(n=5))
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "8")
        await until(pilot, lambda: "predicting" not in forecast(box))
        assert forecast(box).startswith("too little traffic to predict: 5 finished requests "
                                        "(need 20)")
        await pilot.press("escape")


async def test_a_key_no_simulation_models_is_not_predicted_and_fetches_nothing():
    ctl = TracingControl(trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "telemetry_max_requests", "0")   # a risky one
        assert forecast(box) == ("not predicted: telemetry_max_requests changes neither "
                                 "scheduling nor the KV pool's capacity")
        await pilot.press("escape")
    assert traces(ctl) == 0


# --- the Advice screen ---------------------------------------------------------------------------

async def test_an_advice_row_carries_its_predicted_effect():
    ctl = TracingControl(trace_text(), config=None)    # FakeControl's: what the stream says
    app = replay_app(records=list(generate(**SLOW_SCHEDULER)), control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches)
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AdviceScreen)
        await until(pilot, lambda: screen.advice and (p := screen.prediction(screen.advice[0]))
                    is not None and p.ready)
        (a,) = screen.advice
        want = expected(a.change)
        cell = str(screen.table.get_cell(a.id, "change"))
        assert "policy fcfs → hybrid" in cell
        assert (f"tok/s {want.before['output_tok_s']:.0f}→{want.after['output_tok_s']:.0f}"
                in cell and "TTFT p99" in cell and "preempt" in cell)
        detail = text_of(screen.query_one("#adv-detail", Static))
        assert "predicted: tok/s" in detail and "(simulated from the engine's last 80 requests over" in detail and "ITL p99" in detail
        assert screen.query_one("#adv-detail").region.bottom <= 23
        # shown again: predicted again, from the cached trace (one fetch within 10 s)
        await pilot.press("1", "a")
        await until(pilot, lambda: not screen._predicting)
        assert traces(ctl) == 1


async def test_without_a_control_channel_advice_and_what_if_say_so():
    app = replay_app(records=list(generate(**SLOW_SCHEDULER)))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AdviceScreen)
        await until(pilot, lambda: screen.advice and screen.prediction(screen.advice[0])
                    is not None and not screen._predicting)
        app.refresh_view(force=True)
        await pilot.pause()
        assert NO_CHANNEL in text_of(screen.query_one("#adv-detail", Static))
        await pilot.press("w")
        assert isinstance(app.screen, WhatIfScreen)
        await pilot.pause()
        assert NO_CHANNEL in text_of(app.screen.query_one("#wi-summary", Static))


# --- the What-if screen ----------------------------------------------------------------------------

async def open_whatif(pilot, app) -> WhatIfScreen:
    await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None)
    await pilot.press("w")
    screen = app.screen
    assert isinstance(screen, WhatIfScreen)
    await until(pilot, lambda: screen.result is not None and screen.result.ready)
    return screen


def cells(screen: WhatIfScreen, figure_key: str) -> list[str]:
    return [str(c) for c in screen.table.get_row(figure_key)]


async def test_the_what_if_screen_edits_a_key_and_shows_live_now_and_with_the_edits():
    ctl = TracingControl(trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        assert screen.query_one("#wi-max_num_seqs", Input).value == "32"   # the live config
        assert [str(c.label) for c in screen.table.columns.values()] == [
            "figure", "live", "now", "now vs live", "with edits", "±", "change"]
        summary = text_of(screen.query_one("#wi-summary", Static))
        assert "80 requests over " in summary and "steps" in summary
        base = expected({})
        # this trace is the simulator's own: "now" reproduces live exactly, nothing is rough
        assert cells(screen, "ttft_p99_s")[1:5] == [figure("ttft_p99_s", base.live["ttft_p99_s"]),
                                                    figure("ttft_p99_s", base.before["ttft_p99_s"]),
                                                    "0%", "="]
        assert "rough" not in text_of(screen.query_one("#wi-note", Static))
        await pilot.press("e")
        box = screen.query_one("#wi-max_num_seqs", Input)
        assert box.has_focus
        await pilot.press("end", "backspace", "backspace", "8", "enter")
        await until(pilot, lambda: screen.result is not None and screen.result.ready
                    and screen.result.change == {"max_num_seqs": 8})
        want = expected({"max_num_seqs": 8})
        for key in ("output_tok_s", "ttft_p99_s", "preemptions"):
            row = cells(screen, key)
            assert [row[1], row[2], row[4]] == [figure(key, want.live[key]),
                                                figure(key, want.before[key]),
                                                figure(key, want.after[key])]
            assert row[6] == change_pct(want.before[key], want.after[key])
            stated = want.after_stated.get(key)   # each figure's interval, as its half-width
            assert row[5] == (tolerance(stated) if stated is not None else "")
        # the KV peak as a share of the pool and in blocks
        assert cells(screen, "kv_usage_peak")[1] == figure("kv_usage_peak",
                                                           want.live["kv_usage_peak"])
        assert cells(screen, "kv_peak_blocks")[1:3] == [
            f"{want.live['kv_peak_blocks']}/{BLOCKS}", f"{want.before['kv_peak_blocks']}/{BLOCKS}"]
        assert "with edits max_num_seqs=8" in text_of(screen.query_one("#wi-note", Static))
        # the table and the note fit 80x24 above the footer
        assert screen.query_one("#wi-note").region.bottom <= 23

        # a value the config refuses: the reason, and nothing runs
        await pilot.press("backspace", "0", "enter")
        error = text_of(screen.query_one("#wi-error", Static))
        assert error.startswith("✗ max_num_seqs:") and screen.result.change == {"max_num_seqs": 8}
        # esc leaves the editor; x resets the edits to the live config and predicts again
        await pilot.press("escape", "x")
        assert screen.query_one("#wi-max_num_seqs", Input).value == "32"
        await until(pilot, lambda: screen.result.ready and screen.result.change == {})
        assert traces(ctl) == 1                     # one fetch served every run
    assert sets(ctl) == []


async def test_the_what_if_screen_shows_how_far_now_is_from_live_and_marks_rough_figures():
    ctl = TracingControl(late_trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        await pilot.press("e", "end", "backspace", "backspace", "8", "enter")
        await until(pilot, lambda: screen.result.ready and screen.result.change)
        want = expected({"max_num_seqs": 8}, late_trace_text())
        err = want.error
        assert abs(err["ttft_p50_s"]) > 0.3 and "ttft_p50_s" in want.rough
        ttft = cells(screen, "ttft_p50_s")
        assert ttft[1] == figure("ttft_p50_s", want.live["ttft_p50_s"])
        assert ttft[2] == f"{figure('ttft_p50_s', want.before['ttft_p50_s'])} !"
        assert ttft[3] == pct(err["ttft_p50_s"])
        assert ttft[4] == f"{figure('ttft_p50_s', want.after['ttft_p50_s'])} !"
        itl = cells(screen, "itl_p50_s")          # the gaps were not moved: no mark
        assert "!" not in itl[2] + itl[4] and itl[3] == pct(err["itl_p50_s"])
        note = " ".join(text_of(screen.query_one("#wi-note", Static)).split())
        assert "with edits max_num_seqs=8" in note
        assert f"! {want.rough_line()}" in note
        said = note.split("! ", 1)[1]
        assert "TTFT p50" in said and "ITL" not in said and said.endswith("as rough")
        assert screen.query_one("#wi-note").region.bottom <= 23


def test_the_rough_line_names_the_figures_or_counts_them_when_they_are_many():
    live = {k: 1.0 for k in FIGURES}
    one = Prediction(READY, {}, before={**live, "ttft_p99_s": 1.68}, after=live, live=live,
                     trace=TraceInfo(80, 400, 60.0, model_error=0.081))
    assert one.rough == ["ttft_p99_s"] and one.error["ttft_p99_s"] == pytest.approx(0.68)
    assert one.rough_line() == ("now misses live by more than the model's ±8.1% on TTFT p99: "
                                "treat that prediction as rough")
    every = Prediction(READY, {}, before={k: 2.0 for k in FIGURES}, after=live, live=live,
                       trace=one.trace)
    assert every.rough_line() == ("now misses live by more than the model's ±8.1% on 8 of 8 "
                                  "figures (marked !): treat those predictions as rough")
    unknown = Prediction(READY, {}, before=one.before, after=live, live=live,
                         trace=TraceInfo(80, 400, 60.0))      # no fit error known: no claim
    assert unknown.rough == [] and unknown.rough_line() == ""


async def test_a_pool_sized_from_memory_shows_its_real_size_as_live():
    ctl = TracingControl(trace_text(), config=EngineConfig(max_num_seqs=SEATS))
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        eng = app.frame("whatif").engine
        pool = eng.latest["kv"]["num_blocks"]
        await until(pilot, lambda: "live " in text_of(screen.query_one("#wi-live-num_kv_blocks")))
        label = text_of(screen.query_one("#wi-live-num_kv_blocks"))
        assert label == f"live {pool} (sized from memory)"
        assert screen.query_one("#wi-num_kv_blocks", Input).value == str(pool)
        assert screen.edits() == {}                 # the real pool is no edit
        await pilot.press("r")
        await until(pilot, lambda: screen.result.ready)
        assert screen.result.change == {}


async def test_the_what_if_screens_apply_confirms_with_the_same_prediction():
    ctl = TracingControl(trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        await pilot.press("e", "end", "backspace", "backspace", "8", "enter")
        await until(pilot, lambda: screen.result.ready and screen.result.change)
        await pilot.press("escape", "A")
        box = app.screen
        assert isinstance(box, ConfirmScreen) and "max_num_seqs 32 → 8" in box.title_text
        assert "predicted" in forecast(box)         # known already: no second simulation
        await pilot.press("tab", "enter")
        await until(pilot, lambda: sets(ctl))
    assert sets(ctl) == [{"max_num_seqs": 8}] and ctl.config.max_num_seqs == 8


async def test_read_only_predicts_but_offers_no_apply_and_help_lists_what_if():
    ctl = TracingControl(trace_text())
    app = replay_app(control=ctl, readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        assert "A" not in screen.active_bindings
        assert "read-only: predicts, never applies" in text_of(
            screen.query_one("#wi-summary", Static))
        await pilot.press("A")
        assert app.screen is screen
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = text_of(app.screen.query_one("#help-text", Static))
        assert "What-if" in help_text and "read-only: predicts, never applies" in help_text
    assert sets(ctl) == []


# --- calibration -------------------------------------------------------------------------------------

def write_calibration(root) -> Any:
    """A calibration of an engine like `trace_text`'s (same model and cost keys) that ran 1-4
    rows, each row costing 10x what the trace's did: after its level is matched to the trace,
    a 4-seat change costs far more per step than the trace alone says."""
    header = parse_lines(trace_text().splitlines(keepends=True), "trace").header
    reqs = [RequestRecord(arrival=0.05 * i, finish=0.05 * i, prompt_len=64, output_len=24,
                          max_tokens=24, ignore_eos=True) for i in range(60)]
    cost = StepCostModel({"const": 0.001, "prefill": 2e-5, "decode": 4e-3, "context": 1e-7,
                          "prefill_attn": 0.0, "new_reqs": 2e-4},
                         {"const": 0.0005, "reqs": 1e-5}, 0)
    ran = simulate(Trace(header, reqs), EngineConfig(num_kv_blocks=BLOCKS, max_num_seqs=4),
                   BLOCKS, cost, max_model_len=2048, vocab_size=256)
    path = calibration_path(stored_trace_path(header, root))
    path.write_text("".join(trace_lines(Trace(header, ran.requests, ran.steps))))
    return path


async def test_a_calibration_of_an_engine_like_this_one_changes_the_prediction_and_is_named(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CALIBRATIONS", str(tmp_path))
    plain = expected({"max_num_seqs": 4})
    assert plain.trace.calibration == NO_CALIBRATION
    write_calibration(tmp_path)
    calibrated = expected({"max_num_seqs": 4})
    assert calibrated.trace.calibration.startswith("calibrated ")
    assert figure("output_tok_s", calibrated.after["output_tok_s"]) != figure(
        "output_tok_s", plain.after["output_tok_s"])
    ctl = TracingControl(trace_text())
    app = replay_app(control=ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        summary = text_of(screen.query_one("#wi-summary", Static))
        assert calibrated.trace.calibration in summary, summary
        await pilot.press("e", "end", "backspace", "backspace", "4", "enter")
        await until(pilot, lambda: screen.result.ready and screen.result.change)
        assert cells(screen, "output_tok_s")[4] == figure(
            "output_tok_s", calibrated.after["output_tok_s"])


async def test_without_a_calibration_the_screen_says_the_costs_come_from_the_trace(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CALIBRATIONS", str(tmp_path))
    app = replay_app(control=TracingControl(trace_text()))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_whatif(pilot, app)
        assert NO_CALIBRATION in text_of(screen.query_one("#wi-summary", Static))
        assert "c" in screen.active_bindings


def test_a_newer_unusable_calibration_is_passed_over_for_the_newest_usable_one(tmp_path):
    good = write_calibration(tmp_path)
    trace = parse_lines(trace_text().splitlines(keepends=True), "trace")
    half = calibration_path(stored_trace_path(trace.header, tmp_path, now=4_000_000_000))
    half.write_text(next(trace_lines(trace)))     # a header only: a probe cut short
    calib, line = pick(trace, tmp_path)
    assert calib is not None and len(calib.steps) == len(read_trace(good).steps)
    assert line.startswith("calibrated ")
    half.unlink()
    good.write_text(next(trace_lines(trace)))
    calib, line = pick(trace, tmp_path)
    assert calib is None and "unusable" in line and line.endswith("step costs fitted on the trace")


async def test_the_box_predicts_with_the_calibration_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CALIBRATIONS", str(tmp_path))
    write_calibration(tmp_path)
    want = expected({"max_num_seqs": 4})
    app = replay_app(control=TracingControl(trace_text()))
    async with app.run_test(size=(80, 24)) as pilot:
        box = await ask_change(pilot, app, "max_num_seqs", "4")
        await until(pilot, lambda: "predicted" in forecast(box))
        shown = forecast(box)
        head = shown.splitlines()[0]              # one line: the box fits 80x24
        assert head.startswith("predicted from the last 80 requests over ") and head.endswith(
            ", calibrated:"), head
        tok = next(ln for ln in shown.splitlines() if ln.strip().startswith("output tok/s"))
        assert f"→ {figure('output_tok_s', want.after['output_tok_s'])}" in tok
        assert box.query_one("#confirm").region.bottom <= 24
        await pilot.press("escape")
