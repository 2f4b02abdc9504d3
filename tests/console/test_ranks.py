"""The aggregate over a data-parallel group's ranks (`vconsole.console.ranks`), on hand-made
bodies: what the console's Ranks screen and `vconsole top --json` show of a group."""

from __future__ import annotations

import pytest

from vconsole.console.ranks import aggregate, imbalance, is_imbalanced, placement_line


def bodies(waiting: int, running: int, *, used: int, blocks: int, tok_s: float,
           dummy_share: float, steps: int, wave: int, running_wave: bool = True,
           state: str = "ok") -> dict[str, dict]:
    return {
        "sched": {"num_waiting": waiting, "num_running": running, "num_preempted": 1},
        "step": {"tokens_per_s": tok_s, "steps_per_s": 10.0,
                 "phase_s": {"schedule": 0.01, "execute": 0.08, "update": 0.01}},
        "kv": {"num_used": used, "num_blocks": blocks},
        "dp": {"world_size": 2, "wave": wave, "wave_running": running_wave,
               "group_state": state, "steps_total": steps, "dummy_share": dummy_share,
               "dummy_steps_total": round(dummy_share * steps), "sync_s_per_step": 0.0002},
    }


def test_the_aggregate_sums_queues_weights_kv_by_blocks_and_averages_the_dummy_share():
    agg = aggregate({0: bodies(10, 6, used=90, blocks=100, tok_s=500.0, dummy_share=0.0,
                               steps=300, wave=4),
                     1: bodies(0, 2, used=10, blocks=300, tok_s=100.0, dummy_share=0.5,
                               steps=100, wave=3, running_wave=False, state="broken")})
    assert (agg["num_waiting"], agg["num_running"], agg["num_preempted"]) == (10, 8, 2)
    assert agg["tokens_per_s"] == 600.0 and agg["steps_per_s"] == 20.0
    assert agg["kv_usage"] == pytest.approx(100 / 400)          # not the mean 0.466
    assert agg["dummy_share"] == pytest.approx(0.25)            # the ranks' windows, lockstep
    assert agg["dummy_share_total"] == pytest.approx(50 / 400)  # Σ dummy / Σ steps
    assert agg["phase_s"]["execute"] == pytest.approx(0.16)
    assert agg["sched_share"] == pytest.approx(0.1)
    assert agg["wave"] == 4 and not agg["waves_agree"] and agg["wave_running"]
    assert agg["group_states"] == {"ok": 1, "broken": 1}
    assert agg["load"] == {"0": 16, "1": 2}
    assert agg["imbalance"] == pytest.approx(16 / 9) and agg["imbalanced"]
    assert agg["world_size"] == 2 and agg["ranks"] == 2


def test_the_aggregate_names_the_groups_kv_format_and_sums_its_capacity():
    one, two = (bodies(0, 1, used=1, blocks=100, tok_s=1.0, dummy_share=0.0, steps=1, wave=1)
                for _ in range(2))
    for b, dtype in ((one, "int8_per_token_head"), (two, "int8_per_token_head")):
        b["kv"].update(cache_dtype=dtype, bytes_per_token=1088, capacity_tokens=1600,
                       pool_bytes=1600 * 1088)
    agg = aggregate({0: one, 1: two})
    assert (agg["kv_cache_dtype"], agg["kv_bytes_per_token"]) == ("int8_per_token_head", 1088)
    assert agg["kv_capacity_tokens"] == 3200 and agg["kv_pool_bytes"] == 2 * 1600 * 1088
    two["kv"].update(cache_dtype="float32", bytes_per_token=4096)   # ranks that disagree
    agg = aggregate({0: one, 1: two})
    assert agg["kv_cache_dtype"] == "float32, int8_per_token_head"
    assert agg["kv_bytes_per_token"] is None
    for b in (one, two):                      # engines from before the KV dtypes
        b["kv"] = {"num_used": 1, "num_blocks": 100}
    agg = aggregate({0: one, 1: two})
    assert agg["kv_cache_dtype"] is None and agg["kv_capacity_tokens"] is None


def test_imbalance_is_max_over_mean_and_flags_only_real_load():
    assert imbalance([5]) is None
    assert imbalance([0, 0]) == 1.0
    assert imbalance([6, 2]) == pytest.approx(1.5)
    assert is_imbalanced([6, 2]) and not is_imbalanced([5, 5])
    assert not is_imbalanced([1, 0])        # one request against none is not a problem
    assert aggregate({})["num_waiting"] is None and aggregate({})["imbalance"] is None


def test_top_json_aggregate_carries_each_ranks_node_and_actor() -> None:
    bodies = {r: {"dp": {"world_size": 2, "node": f"n{r}", "actor": f"vconsole_dp_rank_{r}"}}
              for r in (0, 1)}
    agg = aggregate(bodies)
    assert agg["placement"] == {"0": {"node": "n0", "actor": "vconsole_dp_rank_0"},
                                "1": {"node": "n1", "actor": "vconsole_dp_rank_1"}}
    mp = aggregate({0: {"dp": {"world_size": 2, "node": "host", "actor": None}}})
    assert mp["placement"] == {"0": {"node": "host", "actor": None}}
    assert placement_line(mp["placement"]) == []
