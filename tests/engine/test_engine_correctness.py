"""Greedy output of the engine equals transformers' own `generate` token for token.

The reference is the stock Llama (its own attention, its own KV cache), one prompt at a time; the
engine runs many prompts at once over its paged KV pool, in every scheduling regime that changes
which tokens share a forward pass: mixed lengths, forced chunked prefill, forced preemption,
shared prefixes served from the prefix cache, and every policy.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker.tiny_model import ensure_tiny_model
from vconsole.shared.config import EngineConfig

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models"))


def _prompts(seed: int, n: int, lo: int, hi: int, vocab: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


MIXED = _prompts(1, 20, 2, 120)
_SHARED = _prompts(2, 1, 70, 70)[0]
PREFIXED = [_SHARED + tail for tail in _prompts(3, 8, 1, 20)]


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation of every prompt used below."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model.eval()
    out: dict[tuple[int, ...], list[int]] = {}
    with torch.inference_mode():
        for ids in MIXED + PREFIXED:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=MAX_TOKENS)
            out[tuple(ids)] = y[0, len(ids):].tolist()
    return out


def _run(model_dir, prompts, priorities=None, **cfg):
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **cfg))
    result = run_batch(core, greedy_requests(core, prompts, MAX_TOKENS, priorities=priorities))
    assert all(o.finish_reason in ("length", "stop") for o in result.outputs)
    return core, result


def _assert_equal(reference, prompts, result):
    for ids, got in zip(prompts, result.output_token_ids, strict=True):
        assert got == reference[tuple(ids)], f"prompt of {len(ids)} tokens diverged"


def test_many_mixed_length_prompts_at_once(model_dir, reference):
    _, result = _run(model_dir, MIXED)
    _assert_equal(reference, MIXED, result)


def test_chunked_prefill_forced_by_a_small_token_budget(model_dir, reference):
    core, result = _run(model_dir, MIXED, max_num_batched_tokens=24)
    _assert_equal(reference, MIXED, result)
    assert result.num_steps > max(len(p) for p in MIXED) // 24


def test_preemption_forced_by_a_small_kv_pool(model_dir, reference):
    _, result = _run(model_dir, MIXED, num_kv_blocks=14, block_size=16, max_num_seqs=16)
    assert result.num_preemptions > 0
    _assert_equal(reference, MIXED, result)


def test_shared_prefixes_hit_the_prefix_cache(model_dir, reference):
    _, result = _run(model_dir, PREFIXED, max_num_seqs=2)
    assert result.prefix_hits > 0
    assert any(o.num_cached_tokens > 0 for o in result.outputs)
    _assert_equal(reference, PREFIXED, result)


def test_prefix_caching_off_gives_the_same_tokens_and_no_hits(model_dir, reference):
    _, result = _run(model_dir, PREFIXED, max_num_seqs=2, enable_prefix_caching=False)
    assert result.prefix_hits == 0
    _assert_equal(reference, PREFIXED, result)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "hybrid"])
def test_every_policy_under_pressure(model_dir, reference, policy):
    rng = random.Random(7)
    prios = [rng.randint(0, 3) for _ in MIXED]
    _, result = _run(model_dir, MIXED, priorities=prios, policy=policy, num_kv_blocks=20,
                     max_num_batched_tokens=64)
    _assert_equal(reference, MIXED, result)


def test_an_impossible_request_is_rejected_and_the_rest_still_run(model_dir, reference):
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=16,
                                   block_size=16))
    reqs = greedy_requests(core, [MIXED[0], [5 + i % 200 for i in range(16 * 16 + 1)], MIXED[1]],
                           MAX_TOKENS)
    result = run_batch(core, reqs)
    assert result.outputs[1].finish_reason == "error" and result.outputs[1].error
    assert result.output_token_ids[0] == reference[tuple(MIXED[0])]
    assert result.output_token_ids[2] == reference[tuple(MIXED[1])]


def test_decodes_split_into_length_groups_give_the_same_tokens(model_dir, reference,
                                                               monkeypatch):
    from vconsole.engine.worker import step_inputs

    monkeypatch.setattr(step_inputs, "DECODE_GROUP_ROWS", 4)
    assert [hi - lo for lo, hi in step_inputs.decode_groups(20)] == [5, 5, 5, 5]
    _, result = _run(model_dir, MIXED)
    _assert_equal(reference, MIXED, result)
