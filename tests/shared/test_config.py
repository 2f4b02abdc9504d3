"""Config validation: types, ranges, cross-field rules, hot vs restart-only keys."""

import pytest

from vconsole.shared.config import (
    HOT_KEYS,
    RESTART_KEYS,
    ConfigError,
    EngineConfig,
    apply_update,
    coerce_value,
    describe_config,
    validate_config,
)


def test_strings_from_the_cli_are_parsed_into_their_types():
    assert coerce_value("max_num_seqs", "8") == 8
    assert coerce_value("enable_prefix_caching", "off") is False
    assert coerce_value("telemetry_hz", "2.5") == 2.5
    assert coerce_value("max_holding_seconds", "none") is None


@pytest.mark.parametrize("key,value,why", [
    ("max_num_seqs", 0, ">= 1"),
    ("max_num_seqs", "lots", "integer"),
    ("policy", "random", "one of"),
    ("enable_prefix_caching", "maybe", "boolean"),
    ("no_such_key", 1, "unknown"),
])
def test_bad_values_are_rejected_with_a_reason_and_change_nothing(key, value, why):
    cur = EngineConfig()
    upd = apply_update(cur, {key: value, "max_num_seqs": 3} if key != "max_num_seqs" else
                       {key: value})
    assert why in upd.rejected[key]
    assert upd.config is cur and upd.applied == {}


def test_hot_change_is_applied_and_reported():
    upd = apply_update(EngineConfig(), {"max_num_seqs": "2", "policy": "priority"})
    assert upd.ok and upd.applied == {"max_num_seqs": 2, "policy": "priority"}
    assert upd.config.max_num_seqs == 2


def test_restart_only_keys_are_answered_restart_required_not_ignored():
    cur = EngineConfig()
    upd = apply_update(cur, {"block_size": 32, "max_num_seqs": 4})
    assert upd.restart_required == ["block_size"]
    assert upd.config is cur
    same = apply_update(cur, {"block_size": cur.block_size})
    assert same.ok and same.applied == {}


def test_cross_field_rule_warning_below_critical():
    upd = apply_update(EngineConfig(), {"alert_waiting_warning": 500})
    assert "alert_waiting_warning" in upd.rejected
    with pytest.raises(ConfigError) as e:
        validate_config({"alert_gpu_memory_warning": 0.99})
    assert "alert_gpu_memory_warning" in e.value.reasons


def test_every_key_is_described_and_classified():
    rows = describe_config()
    assert {r["key"] for r in rows} == HOT_KEYS | RESTART_KEYS
    assert all(r["description"] for r in rows)
    for k in ("model", "device", "dtype", "block_size", "num_kv_blocks"):
        assert k in RESTART_KEYS
    for k in ("max_num_seqs", "max_num_batched_tokens", "policy", "max_holding_seconds",
              "enable_prefix_caching", "telemetry_hz", "heartbeat_interval_s",
              "fragmentation_threshold", "log_stats"):
        assert k in HOT_KEYS
