"""The n-gram proposer's lookup and the speculative config's refusals (no model)."""

from __future__ import annotations

import pytest

from vconsole.engine.spec.ngram import NgramProposer
from vconsole.engine.spec.policy import can_speculate
from vconsole.shared.config import ConfigError, apply_update, validate_config
from vconsole.shared.speculative import parse_speculative_config
from vconsole.wire.sampling import SamplingParams


def test_the_tokens_after_the_latest_longest_match_are_proposed():
    p = NgramProposer(k=3, lo=1, hi=3)
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    # "6 7" occurs at 1-2 and 6-7; the latest is followed by 3 4 6
    assert p.propose(tokens) == [3, 4, 6]
    # a longer match wins over a later shorter one: "5 6 7" at 0-2 beats "6 7" at 6-7
    assert p.propose([5, 6, 7, 8, 8, 1, 6, 7, 2, 5, 6, 7]) == [8, 8, 1]
    assert p.propose(tokens, max_tokens=2) == [3, 4]


def test_no_draft_below_the_minimum_match_or_without_a_match():
    assert NgramProposer(k=3, lo=3, hi=4).propose([1, 2, 9, 8, 2, 9]) == []   # only "2 9"
    assert NgramProposer(k=3, lo=2, hi=4).propose([1, 2, 9, 8, 2, 9]) == [8, 2, 9]
    assert NgramProposer(k=3, lo=1, hi=3).propose([1, 2, 3, 4]) == []
    assert NgramProposer(k=3, lo=1, hi=3).propose([7]) == []
    # the match may run up to the end: the draft is what follows it, cut at the end
    assert NgramProposer(k=5, lo=1, hi=2).propose([4, 4]) == [4]


def test_requests_that_read_per_position_state_do_not_speculate():
    assert can_speculate(SamplingParams(max_tokens=4), 0)
    assert not can_speculate(SamplingParams(max_tokens=4, logprobs=1), 0)
    assert not can_speculate(SamplingParams(max_tokens=4, presence_penalty=0.5), 0)
    assert not can_speculate(SamplingParams(max_tokens=9, min_tokens=3), 2)
    assert can_speculate(SamplingParams(max_tokens=9, min_tokens=3), 3)


def test_vllm_fields_and_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (4, 5, 5)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (3, 3)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("raw, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
     "unsupported field(s) model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, '
     '"prompt_lookup_min": 3}', "exceeds prompt_lookup_max"),
    ('{"method": "ngram", ', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_configs_are_refused_with_the_reason(raw, words):
    with pytest.raises(ValueError, match=None) as info:
        parse_speculative_config(raw)
    assert words in str(info.value)
    with pytest.raises(ConfigError) as info2:
        validate_config({"speculative_config": raw})
    assert "speculative_config" in info2.value.reasons


def test_the_engine_config_refuses_kivi_and_restarts_for_a_change_but_hot_toggles():
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    with pytest.raises(ConfigError) as info:
        validate_config({"speculative_config": spec, "kv_cache_dtype": "int4_kivi"})
    assert "not supported with kv_cache_dtype" in info.value.reasons["speculative_config"]
    cfg = validate_config({"speculative_config": spec})
    assert apply_update(cfg, {"speculative_config": None}).restart_required == \
        ["speculative_config"]
    update = apply_update(cfg, {"speculative_decoding": "off"})
    assert update.ok and update.config.speculative_decoding is False
