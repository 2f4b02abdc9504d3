"""The tuning advisor on generated telemetry: each rule fires on sustained evidence, stays quiet
without it, and only ever suggests a value the engine would take that is not already in force."""

from __future__ import annotations

from typing import Any

import pytest

from support.synthetic import generate
from vconsole.console.advisor import Advice, Advisor
from vconsole.shared.config import EngineConfig, apply_update
from vconsole.telemetry.schema import decode

QUIET = {"slow_window": (0, 0), "burst_window": (0, 0)}      # no slow scheduler, no burst
# The scheduler is slow all along and the load reaches max_num_seqs (32): the write-up's case.
SLOW_SCHEDULER = {"slow_window": (0, 2), "burst_window": (0, 0), "rate": 14}
FRAGMENTED = {**QUIET, "block_size": 128, "prompt_range": (8, 40), "output_range": (4, 20)}
KV_STARVED = {**QUIET, "num_blocks": 160, "rate": 20}
KV_ROOMY = {**QUIET, "num_blocks": 4096, "rate": 3}
# Short prompts, long outputs, a 64-token step budget: decodes fill the steps, prompts queue.
DECODE_BOUND = {**QUIET, "num_blocks": 8192, "max_num_batched_tokens": 64, "max_num_seqs": 128,
                "prompt_range": (4, 8), "output_range": (200, 400), "rate": 12,
                "policy": "fcfs"}
DECODE_ROOMY = {**DECODE_BOUND, "max_num_batched_tokens": 512, "rate": 4}
SLOW_STEPS = {**QUIET, "exec_s": 0.6}


_streams: dict[Any, list[Any]] = {}


def replay(duration_s: float = 20.0, **kw: Any) -> tuple[Advisor, dict[str, Advice]]:
    """Feed a generated stream; return the advisor and the first advice of each id it gave at
    any point (the advice after every message, not only at the end)."""
    key = (duration_s, tuple(sorted(kw.items())))
    if key not in _streams:    # several tests read the same scenario: decode it once
        _streams[key] = [decode(frames) for _ts, frames in generate(duration_s, **kw)]
    adv = Advisor()
    seen: dict[str, Advice] = {}
    for msg in _streams[key]:
        adv.observe(msg)
        for a in adv.current():
            seen.setdefault(a.id, a)
    return adv, seen


def rules(seen: dict[str, Advice]) -> set[str]:
    return {a.rule for a in seen.values()}


def in_force(**kw: Any) -> EngineConfig:
    """The config the synthetic engine announces for these knobs."""
    keys = ("max_num_seqs", "max_num_batched_tokens", "block_size")
    values = {k: kw[k] for k in keys if k in kw}
    values.setdefault("max_num_seqs", 32)
    if "policy" in kw:
        values["policy"] = kw["policy"]
    return EngineConfig(num_kv_blocks=kw.get("num_blocks", 1024), **values)


def assert_engine_takes(advice: Advice, cfg: EngineConfig) -> None:
    update = apply_update(cfg, advice.change)
    assert not update.rejected
    if advice.hot:
        assert update.applied == advice.change
    else:
        assert update.restart_required == sorted(advice.change)
    for key, value in advice.change.items():
        assert value != getattr(cfg, key) and advice.current[key] != value


# --- scheduler share (the write-up's case) ----------------------------------------------------

def test_a_slow_scheduler_suggests_hybrid_and_fewer_sequences():
    adv, seen = replay(**SLOW_SCHEDULER)
    (a,) = adv.current()
    assert a.rule == "sched_share" and a.hot
    assert a.change["policy"] == "hybrid" and 1 <= a.change["max_num_seqs"] < 32
    assert a.current == {"policy": "fcfs", "max_num_seqs": 32}
    assert a.evidence["sched_share"] > a.evidence["threshold"] == 0.15
    assert a.evidence["held_in"] >= 0.8 * a.evidence["snapshots"]
    assert "policy fcfs → hybrid" in a.change_text() and "of step time" in a.message
    assert_engine_takes(a, in_force())


def test_below_the_concurrency_cap_only_the_policy_is_suggested():
    _, seen = replay(**{**SLOW_SCHEDULER, "rate": 6})
    (a,) = seen.values()
    assert a.change == {"policy": "hybrid"} and a.evidence["running_peak"] < 0.9 * 32


def test_a_scheduler_slow_in_one_window_of_three_gives_no_advice():
    _, seen = replay(**{**SLOW_SCHEDULER, "slow_window": lambda i, frac: i % 3 == 0})
    assert "sched_share" not in rules(seen)


def test_no_advice_before_the_evidence_spans_half_the_window():
    _, seen = replay(duration_s=4, **SLOW_SCHEDULER)
    assert seen == {}


def test_a_value_already_in_force_is_not_suggested_again():
    _, seen = replay(policy="hybrid", **SLOW_SCHEDULER)
    (a,) = seen.values()
    assert set(a.change) == {"max_num_seqs"}                  # hybrid is already the policy
    _, seen = replay(policy="hybrid", max_num_seqs=1, **SLOW_SCHEDULER)
    assert seen == {}                                         # nothing lower than 1 either


def test_applying_the_change_drops_the_old_evidence():
    adv, _ = replay(**SLOW_SCHEDULER)
    (a,) = adv.current()
    adv.set_config({**in_force().to_dict(), **a.change})
    assert adv.current() == []                                # needs fresh evidence
    adv.set_config({**in_force().to_dict(), **a.change})      # the same config again: no-op
    adv.observe_payload("step", {"ts": 2e9, "steps": 8, "sched_share": 0.3})
    assert adv.current() == []


# --- KV fragmentation ---------------------------------------------------------------------------

def test_fragmented_blocks_suggest_a_smaller_block_size_restart_only():
    adv, seen = replay(**FRAGMENTED)
    (a,) = [a for a in seen.values() if a.rule == "fragmentation"]
    assert a.change == {"block_size": 64} and not a.hot
    assert a.evidence["fragmentation"] > a.evidence["threshold"] == 0.5
    assert "--set block_size=64" in a.restart_command() and "Restart-only" in a.message
    assert_engine_takes(a, in_force(block_size=128))


def test_small_blocks_do_not_fragment():
    _, seen = replay(**QUIET)
    assert "fragmentation" not in rules(seen)


def test_a_lower_fragmentation_threshold_is_read_from_the_config():
    adv = Advisor()
    adv.set_config({**EngineConfig(block_size=32).to_dict(), "fragmentation_threshold": 0.2})
    for i in range(60):
        adv.observe_payload("kv", {"ts": 1e9 + i * 0.2, "num_used": 50, "fragmentation": 0.3,
                                   "usage": 0.2, "num_blocks": 1000, "block_size": 32})
    (a,) = adv.current()
    assert a.change == {"block_size": 16} and a.evidence["threshold"] == 0.2


# --- KV pressure ------------------------------------------------------------------------------

def test_a_full_pool_with_a_growing_queue_and_preemptions_suggests_less_concurrency():
    _, seen = replay(**KV_STARVED)
    hot = seen["kv_pressure:max_num_seqs"]
    blocks = seen["kv_pressure:num_kv_blocks"]
    assert hot.hot and hot.change["max_num_seqs"] < 32
    assert not blocks.hot and blocks.change == {"num_kv_blocks": 240}
    ev = hot.evidence
    assert ev["kv_usage"] >= 0.85 and ev["waiting_end"] > ev["waiting_start"]
    assert ev["preemptions"] >= 2
    for a in (hot, blocks):
        assert_engine_takes(a, in_force(num_blocks=160))


def test_a_roomy_pool_gives_no_kv_advice():
    _, seen = replay(**KV_ROOMY)
    assert "kv_pressure" not in rules(seen)


# --- TTFT while decodes dominate ------------------------------------------------------------------

def test_ttft_climbing_under_decode_load_suggests_a_bigger_budget_and_hybrid():
    _, seen = replay(**DECODE_BOUND)
    budget = seen["ttft:max_num_batched_tokens"]
    policy = seen["ttft:policy"]
    assert budget.hot and budget.change == {"max_num_batched_tokens": 128}
    assert policy.hot and policy.change == {"policy": "hybrid"}
    ev = budget.evidence
    assert ev["ttft_p99_end"] > ev["ttft_p99_start"] and ev["decode_share"] >= 0.8
    assert ev["tokens_per_step"] >= 0.8 * ev["token_budget"]
    for a in (budget, policy):
        assert_engine_takes(a, in_force(**DECODE_BOUND))


def test_no_ttft_advice_when_requests_get_their_first_token_quickly():
    _, seen = replay(**DECODE_ROOMY)
    assert "ttft" not in rules(seen)


def test_no_ttft_advice_when_prefill_fills_the_steps():
    _, seen = replay(**KV_STARVED)     # TTFT climbs there too, but prompts dominate the steps
    assert "ttft" not in rules(seen)


# --- long steps ---------------------------------------------------------------------------------

def test_long_prefill_heavy_steps_suggest_smaller_chunks():
    adv, seen = replay(**SLOW_STEPS)
    a = seen["step_time:max_num_batched_tokens"]
    assert a.hot and a.change == {"max_num_batched_tokens": 256}
    assert a.evidence["step_time_p50_s"] >= 0.5 and a.evidence["prefill_share"] >= 0.5
    assert_engine_takes(a, in_force())


def test_fast_steps_give_no_step_time_advice():
    _, seen = replay(**QUIET)
    assert "step_time" not in rules(seen)


# --- the stream in general ---------------------------------------------------------------------

@pytest.mark.parametrize("kw", [QUIET, {}], ids=["quiet", "the recording's scenario"])
def test_an_ordinary_run_gives_no_advice(kw):
    _, seen = replay(duration_s=30, **kw)
    assert seen == {}


def test_idle_windows_clear_the_advice():
    adv, _ = replay(**SLOW_SCHEDULER)
    assert adv.current()
    t = 2e9
    for i in range(100):                      # 10 s of an idle engine's empty step windows
        adv.observe_payload("step", {"ts": t + i * 0.1, "steps": 0, "sched_share": 0.0})
    assert adv.current() == []


# --- seats: the queue waits while every seat is taken and the pool has room --------------------

def seats_stream(adv: Advisor, *, usage: tuple[float, float], preemptions_per_s: float = 0.0,
                 seconds: float = 10.0) -> None:
    """Issue 27 item 12's session: max_num_seqs=4, all 4 running, 29-50 waiting, TTFT p99
    5.3 s, a snapshot every half second; ``usage`` is the KV pool's range over the run."""
    adv.observe_payload("config", {"values": {**in_force(max_num_seqs=4).to_dict()}})
    n = int(seconds * 2)
    for i in range(n):
        ts, frac = 1_700_000_000.0 + i / 2, i / max(1, n - 1)
        adv.observe_payload("sched", {
            "ts": ts, "num_waiting": 29 + round(21 * frac), "num_running": 4,
            "num_preemptions_total": int(i / 2 * preemptions_per_s), "max_num_seqs": 4,
            "max_num_batched_tokens": 2048, "policy": "fcfs"})
        adv.observe_payload("kv", {"ts": ts, "usage": usage[0] + (usage[1] - usage[0]) * frac,
                                   "fragmentation": 0.1, "num_used": 200,
                                   "num_blocks": 1024, "block_size": 16})
        adv.observe_payload("step", {"ts": ts, "steps": 30, "sched_share": 0.02,
                                     "step_time_p50_s": 0.016, "num_prefill_tokens": 40,
                                     "num_decode_tokens": 120})
        adv.observe_payload("latency", {"ts": ts, "overall": {"window": {"ttft_s": {
            "p99": 5.3}}}, "priority": {"0": {}}})


def test_a_queue_waiting_for_seats_with_room_in_the_pool_suggests_more_seats():
    adv = Advisor()
    seats_stream(adv, usage=(0.20, 0.30))
    (a,) = adv.current()
    assert a.rule == "seats" and a.hot
    assert a.current == {"max_num_seqs": 4} and a.change == {"max_num_seqs": 8}
    ev = a.evidence
    assert ev["max_num_seqs"] == 4 and ev["running_mean"] == 4.0
    assert (ev["waiting_min"], ev["waiting_max"]) == (29, 50)
    assert 0.2 <= ev["kv_usage"] <= 0.3 and ev["preemptions"] == 0 and ev["ttft_p99"] == 5.3
    assert ev["held_in"] >= 0.8 * ev["snapshots"]
    assert "29–50 requests waited" in a.message and "TTFT p99 5.30 s" in a.message
    assert "max_num_seqs 4 → 8" in a.message
    assert_engine_takes(a, in_force(max_num_seqs=4))


def test_a_nearly_full_pool_is_not_a_reason_for_more_seats():
    adv = Advisor()
    seats_stream(adv, usage=(0.80, 0.84))     # below KV_FULL, but 4 more would not fit
    assert "seats" not in {a.rule for a in adv.current()}
    adv = Advisor()
    seats_stream(adv, usage=(0.90, 0.95))     # full: the pool is the limit
    assert "seats" not in {a.rule for a in adv.current()}


def test_preemptions_mean_the_pool_not_the_seats_is_the_limit():
    adv = Advisor()
    seats_stream(adv, usage=(0.20, 0.30), preemptions_per_s=1.0)
    assert "seats" not in {a.rule for a in adv.current()}
