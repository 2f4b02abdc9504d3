"""`vconsole bench kv-grouping`: each K/V rounding scheme's perplexity against none, with the
per-token logprob change and the perplexity change's own noise band, on either text."""

from __future__ import annotations

import pytest

from vconsole.tools.bench.kv_grouping import kv_grouping_bench


@pytest.mark.parametrize("text", ["pydoc", "python-license"])
def test_kv_grouping_splits_keys_from_values_and_names_the_noise(text: str) -> None:
    out = kv_grouping_bench("tiny", windows=1, window_tokens=48, only=["int8"], text=text)
    rows = {r["scheme"]: r for r in out["schemes"]}
    assert out["text_name"] == text and out["windows"] == 1
    none = rows.pop("none")
    assert none["rel_diff"] == 0.0 and none["token_logprob_diff_mean"] == 0.0
    assert {"int8 keys per token-head, values exact", "int8 values per token-head, keys exact",
            "int8 keys per channel (KIVI), values per token-head (int8_kivi)",
            "int8 per token-head, symmetric (int8_per_token_head)"} <= set(rows)
    assert all(not name.startswith("int4") for name in rows)      # only=["int8"]
    for r in rows.values():
        assert 0 < r["token_logprob_diff_mean"] <= r["token_logprob_diff_p99"]
        assert r["rel_diff_2se"] > 0


def test_kv_grouping_refuses_windows_the_text_lacks() -> None:
    with pytest.raises(ValueError, match="tokens"):
        kv_grouping_bench("tiny", windows=16, window_tokens=4096, only=["int8"],
                          text="python-license")
