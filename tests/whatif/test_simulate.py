"""The what-if simulator: the step-time fit, the replay through the real scheduler, variants and
their refusals. Traces here are built by hand (`make_trace`): arrivals, prompts that share
prefixes, and step records timed by a known cost, so a fit has a truth to recover."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from vconsole.engine.worker.kv_quant import FORMATS
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.request_trace import (
    RequestRecord,
    StepRecord,
    Trace,
    TraceHeader,
    figures,
    parse_lines,
    trace_lines,
)
from vconsole.whatif.cost_model import MIN_STEPS, TooLittleTraffic, fit
from vconsole.whatif.predict import Baseline, check_key, parse_assignments, whatif

TRUE = {"const": 0.010, "prefill": 0.0004, "decode": 0.002, "context": 1e-6,
        "prefill_attn": 0.0, "new_reqs": 0.001}


def true_dur(s: StepRecord) -> float:
    return (TRUE["const"] + TRUE["prefill"] * s.prefill + TRUE["decode"] * s.decode
            + TRUE["context"] * s.context + TRUE["new_reqs"] * s.new_reqs)


def random_steps(n: int, seed: int = 0, noise: float = 0.02) -> list[StepRecord]:
    rng = random.Random(seed)
    steps, t = [], 0.0
    for _ in range(n):
        pf = rng.choice([0, 0, 0, rng.randint(1, 256)])
        dec = rng.randint(0 if pf else 1, 16)
        s = StepRecord(t=t, dur=0.0, execute=0.0, prefill=pf, decode=dec, reqs=dec + (pf > 0),
                       running=dec + 1, waiting=0, context=dec * rng.randint(50, 400) + pf,
                       prefill_attn=pf * pf, new_reqs=int(pf > 0))
        s.dur = true_dur(s) * (1 + rng.gauss(0, noise))
        s.execute = s.dur * 0.9
        s.period = s.dur + 0.0005 + 0.00002 * s.reqs
        t += s.period
        steps.append(s)
    return steps


def make_trace(num_requests: int = 60, *, rate: float = 20.0, shared_blocks: int = 4,
               num_kv_blocks: int = 64, config: dict | None = None, seed: int = 1) -> Trace:
    """Requests at ``rate``/s: half open with the same ``shared_blocks`` blocks; steps from
    `random_steps` (the fit's material)."""
    rng = random.Random(seed)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
                       **(config or {}))
    shared = [f"{rng.getrandbits(64):016x}" for _ in range(shared_blocks)]
    header = TraceHeader(model="tiny", block_size=16, num_kv_blocks=num_kv_blocks,
                         vocab_size=512, max_model_len=2048, kv_cache_dtype="auto",
                         kv_bytes_per_token=4096,
                         kv_bytes_per_token_by_dtype={"int8_per_token_head": 1088},
                         config=cfg.to_dict())
    trace = Trace(header)
    t = 0.0
    for i in range(num_requests):
        t += rng.expovariate(rate)
        prompt = rng.randint(shared_blocks * 16 + 1, shared_blocks * 16 + 80)
        own = [f"{rng.getrandbits(64):016x}" for _ in range(prompt // 16 - shared_blocks)]
        hashes = (shared if i % 2 == 0 else [f"{rng.getrandbits(64):016x}"
                                             for _ in range(shared_blocks)]) + own
        out = rng.randint(8, 48)
        trace.requests.append(RequestRecord(
            arrival=t, finish=t + 1.0, first_token=t + 0.1, prompt_len=prompt, output_len=out,
            max_tokens=out, block_hashes=hashes[:prompt // 16], ignore_eos=True,
            priority=i % 3, itl_us=[20_000] * (out - 1)))
    trace.steps = random_steps(400)
    return trace


# --- the step-time model ----------------------------------------------------------------------

def test_fit_recovers_known_step_costs_from_noisy_steps():
    model = fit(random_steps(800, noise=0.03))
    for name in ("const", "prefill", "decode", "new_reqs"):
        assert model.coef[name] == pytest.approx(TRUE[name], rel=0.15), name
    assert model.overhead["const"] == pytest.approx(0.0005, rel=0.2)
    assert model.overhead["reqs"] == pytest.approx(0.00002, rel=0.3)
    assert model.rel_error < 0.05


def test_fit_ignores_a_few_very_slow_steps():
    steps = random_steps(600, noise=0.01)
    for s in steps[::50]:              # a shared machine's hiccups: 12 steps 20x too slow
        s.dur *= 20
    model = fit(steps)
    assert model.coef["const"] == pytest.approx(TRUE["const"], rel=0.15)
    assert model.coef["decode"] == pytest.approx(TRUE["decode"], rel=0.15)


def test_fit_never_gives_a_negative_cost():
    steps = random_steps(300)
    for s in steps:                    # a feature that would fit negative: longer is faster
        s.dur = max(1e-4, s.dur - 2e-6 * s.prefill_attn)
    model = fit(steps)
    assert all(v >= 0 for v in model.coef.values())
    assert any("dropped" in n for n in model.notes)


def test_too_few_steps_is_refused_not_guessed():
    with pytest.raises(TooLittleTraffic, match="too little traffic"):
        fit(random_steps(MIN_STEPS - 1))


# --- the simulation -----------------------------------------------------------------------------

def test_baseline_replays_every_request_to_its_recorded_length():
    trace = make_trace()
    result = Baseline(trace).run({})
    assert len(result.requests) == len(trace.requests)
    assert sorted(r.output_len for r in result.requests) == sorted(
        r.output_len for r in trace.requests)
    # Every output token after the first has its gap; tokens are never invented or lost.
    assert all(len(r.itl_us) == r.output_len - 1 for r in result.requests)
    assert all(r.first_token is not None and r.arrival <= r.first_token <= r.finish
               for r in result.requests)


def test_shared_prefixes_hit_the_prefix_cache_in_the_simulation():
    trace = make_trace(rate=2.0)        # spaced out: the shared blocks are cached by then
    result = Baseline(trace).run({})
    by_arrival = sorted(result.requests, key=lambda r: r.arrival)
    shared = [r for i, r in enumerate(by_arrival) if i % 2 == 0][1:]
    assert all(r.num_cached_tokens >= 4 * 16 for r in shared)
    off = Baseline(trace).run({"enable_prefix_caching": False})
    assert all(r.num_cached_tokens == 0 for r in off.requests)


def test_fewer_seats_queue_longer_and_a_smaller_pool_preempts_more():
    trace = make_trace(rate=40.0)
    base = figures(Baseline(trace).run({}).requests)
    one_seat = figures(Baseline(trace).run({"max_num_seqs": 1}).requests)
    assert one_seat["ttft_p50_s"] > 2 * base["ttft_p50_s"]
    assert one_seat["output_tok_s"] < base["output_tok_s"]
    small = Baseline(trace).run({"num_kv_blocks": 12})
    assert small.num_kv_blocks == 12
    assert figures(small.requests)["preemptions"] > base["preemptions"]


def test_capacity_keys_keep_the_pools_bytes():
    base = Baseline(make_trace())
    assert base.sized({"block_size": 8})[1] == 128       # same bytes, half-size blocks
    assert base.sized({"block_size": 32})[1] == 32
    # int8 at 1088 bytes per token instead of 4096: 64 * 16 * 4096 / (16 * 1088) blocks.
    assert base.sized({"kv_cache_dtype": "int8"})[1] == 64 * 16 * 4096 // (16 * 1088)
    assert base.sized({"kv_cache_memory_bytes": 16 * 4096 * 10})[1] == 10


def test_a_per_channel_pool_is_sized_by_its_bytes_per_block_at_the_variants_block_size():

    dims = (4, 4, 64, 4)            # tiny: layers, KV heads, head dim, float32
    trace = make_trace()
    trace.header.kv_block_bytes_by_dtype = {
        name: [fmt.bytes_per_block(2, *dims) - fmt.bytes_per_block(1, *dims),
               2 * fmt.bytes_per_block(1, *dims) - fmt.bytes_per_block(2, *dims)]
        for name, fmt in FORMATS.items()}
    base = Baseline(trace)
    pool = 64 * FORMATS["auto"].bytes_per_block(16, *dims)
    for B in (8, 16, 32):
        exact = pool // FORMATS["int8_kivi"].bytes_per_block(B, *dims)
        assert base.sized({"kv_cache_dtype": "int8_kivi", "block_size": B})[1] == exact
    # The keys' per-channel parameters are per block: bytes per token at 16 tokens a block
    # (the older traces' only figure) would give 32-token blocks fewer than the pool holds.
    kivi16 = FORMATS["int8_kivi"].bytes_per_token(*dims, block_size=16)
    assert pool // (32 * kivi16) < base.sized({"kv_cache_dtype": "int8_kivi",
                                               "block_size": 32})[1]
    budget = 10 * FORMATS["int4_kivi"].bytes_per_block(32, *dims) + 5
    assert base.sized({"kv_cache_dtype": "int4_kivi", "block_size": 32,
                       "kv_cache_memory_bytes": budget})[1] == 10


def test_the_trace_round_trips_through_its_text():
    trace = make_trace(num_requests=25)
    again = parse_lines(list(trace_lines(trace)))
    assert len(again.requests) == 25 and len(again.steps) == len(trace.steps)
    assert again.requests[3].block_hashes == trace.requests[3].block_hashes


def test_report_has_the_issue_s_shape_and_figures():
    report = whatif(make_trace(), [parse_assignments(["max_num_seqs=4"]),
                                   parse_assignments(["policy=fcfs,max_num_batched_tokens=64"])])
    assert set(report) >= {"baseline", "variants", "model", "trace"}
    assert set(report["baseline"]) >= {"config", "observed", "predicted", "error"}
    want = {"output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
            "preemptions", "kv_usage_peak"}
    assert want <= set(report["baseline"]["predicted"])
    assert [v["set"] for v in report["variants"]] == [
        {"max_num_seqs": 4}, {"policy": "fcfs", "max_num_batched_tokens": 64}]
    assert report["variants"][0]["config"]["max_num_seqs"] == 4


# --- refusals -----------------------------------------------------------------------------------

def test_a_key_that_a_simulation_cannot_predict_is_refused_by_name():
    with pytest.raises(ValueError, match="telemetry_hz: not predicted"):
        check_key("telemetry_hz", "5")
    with pytest.raises(ValueError, match="unknown key"):
        parse_assignments(["max_num_seq=4"])
    with pytest.raises(ValueError, match=">= 1"):
        parse_assignments(["max_num_seqs=0"])


def test_too_little_traffic_is_said_not_guessed():
    with pytest.raises(TooLittleTraffic, match="5 finished requests"):
        Baseline(make_trace(num_requests=5))


def test_a_csv_trace_needs_a_trace_for_its_step_costs():
    csv = make_trace()
    csv.header.source = "csv"
    csv.steps = []
    with pytest.raises(TooLittleTraffic, match="--costs"):
        Baseline(csv)
    report = whatif(csv, [], costs=make_trace())
    assert "observed" not in report["baseline"]
    assert report["baseline"]["predicted"]["output_tok_s"] > 0


def test_kv_dtype_the_trace_does_not_size_is_refused():
    with pytest.raises(ValueError, match="int4_kivi"):
        Baseline(make_trace()).sized({"kv_cache_dtype": "int4"})


def test_step_noise_is_the_trace_s_own_spread_and_repeatable():
    steps = random_steps(500, noise=0.0)
    for s in steps[::10]:                   # one step in ten takes 3x: a mean 1.2x the typical
        s.dur *= 3
    model = fit(steps)
    assert model.ratios.mean() == pytest.approx(1.2, abs=0.03)
    draws = [f for f, _ in zip(model.noise(seed=7), range(5000), strict=False)]
    assert sum(draws) / len(draws) == pytest.approx(1.2, abs=0.05)
    trace = make_trace(rate=40.0)
    one, two = Baseline(trace).run({}), Baseline(trace).run({})
    assert figures(one.requests) == figures(two.requests)     # seeded: the same every run


def test_a_pool_too_small_for_the_last_requests_rejects_them_and_ends():
    trace = make_trace(num_requests=30)
    longest = max(trace.requests, key=lambda r: r.prompt_len + r.output_len)
    longest.arrival = max(r.arrival for r in trace.requests) + 1.0     # it arrives last
    trace.requests.sort(key=lambda r: r.arrival)
    need = -(-(longest.prompt_len + longest.output_len - 1) // 16)
    result = Baseline(trace).run({"num_kv_blocks": need - 1})
    assert result.rejected >= 1
    assert len(result.requests) == 30 - result.rejected
    report = whatif(trace, [{"num_kv_blocks": need - 1}])
    assert report["variants"][0]["predicted"]["rejected"] == result.rejected


def test_a_capacity_key_must_have_a_value_and_timeouts_are_counted_apart():
    with pytest.raises(ValueError, match="give a value"):
        check_key("num_kv_blocks", "none")
    trace = make_trace(rate=60.0)
    pred = whatif(trace, [{"max_num_seqs": 1, "max_holding_seconds": 0.2}])
    variant = pred["variants"][0]["predicted"]
    assert variant["timed_out"] > 0
    # The figures are over the requests that ran to their end, as the trace's observed ones.
    assert variant["ttft_p50_s"] is not None and variant["ttft_p50_s"] < 0.2 + 0.5


# --- the step's regime: one native call, or the Python layers (#44 after #47) ------------------

PYTHON_COST = 0.004     # what a step run through the Python layers costs beyond a native one


def regime_steps(n: int, native_rows: int = 4, seed: int = 3) -> list[StepRecord]:
    """`random_steps` as an engine with a native decode step of up to ``native_rows`` rows
    records them: those steps flagged and ``PYTHON_COST`` cheaper than the rest."""
    steps = random_steps(n, seed=seed, noise=0.01)
    for s in steps:
        s.native = s.prefill == 0 and 0 < s.decode <= native_rows
        if not s.native:
            s.dur += PYTHON_COST
            s.period = None if s.period is None else s.period + PYTHON_COST
    return steps


def test_the_fit_tells_the_native_regime_from_the_python_layers():
    model = fit(regime_steps(900), native_rows=4)
    assert model.coef["python"] == pytest.approx(PYTHON_COST, rel=0.15)
    assert model.coef["const"] == pytest.approx(TRUE["const"], rel=0.15)
    assert model.coef["decode"] == pytest.approx(TRUE["decode"], rel=0.15)
    assert model.native_rows == 4 and model.runs_native(0, 4) and not model.runs_native(0, 5)
    assert not model.runs_native(16, 1)            # a prefill chunk: the Python layers
    one = next(s for s in regime_steps(900) if s.native and s.decode == 1)
    assert model.step_dur(one) == pytest.approx(
        model.dur(0, 1, one.context, 0, one.new_reqs) - model.coef["python"])


def test_a_trace_without_native_steps_has_no_regime_term():
    model = fit(random_steps(600), native_rows=4)   # an engine that ran every step in Python
    assert model.coef["python"] == 0.0 and model.native_rows == 0
    assert not any("python" in n for n in model.notes)
    assert model.coef["const"] == pytest.approx(TRUE["const"], rel=0.15)


def test_a_variant_with_fewer_seats_runs_its_small_steps_in_the_native_regime():
    trace = make_trace(num_requests=80, rate=40.0)
    trace.header.native_decode_rows = 4
    trace.steps = regime_steps(600)
    base = Baseline(trace)
    assert base.model.native_rows == 4
    few = base.run({"max_num_seqs": 2})
    busy = [s for s in few.steps if s.prefill + s.decode]
    assert any(s.native for s in busy)
    for s in busy:
        assert s.native == (s.prefill == 0 and s.decode <= 2)
    # One line over both regimes (a fit that cannot tell them apart) misprices the native
    # steps by more than the regime model does.
    native = [s for s in trace.steps if s.native]
    one_line = fit([replace(s, native=False) for s in trace.steps], native_rows=4)
    actual = sum(s.dur for s in native)
    line_err = abs(sum(one_line.step_dur(replace(s, native=False)) for s in native) / actual - 1)
    regime_err = abs(sum(base.model.step_dur(s) for s in native) / actual - 1)
    assert regime_err < 0.03 < line_err
    # A quantized pool runs every step through the Python layers (`NativeDecode.takes`).
    quant = base.run({"kv_cache_dtype": "int8_per_token_head"})
    assert not any(s.native for s in quant.steps)


def test_a_steps_regime_round_trips_through_the_trace_text():
    trace = make_trace()
    trace.header.native_decode_rows = 4
    trace.steps = regime_steps(60)
    back = parse_lines(trace_lines(trace))
    assert back.header.native_decode_rows == 4
    assert [s.native for s in back.steps] == [s.native for s in trace.steps]
    assert any(s.native for s in back.steps) and not all(s.native for s in back.steps)


def test_a_handful_of_native_steps_does_not_make_a_regime_term():
    steps = random_steps(600)
    for s in steps[:10]:            # ten steps flagged among 600: too few to fit a term on
        s.native = True
    model = fit(steps, native_rows=4)
    assert model.coef["python"] == 0.0 and model.native_rows == 0
