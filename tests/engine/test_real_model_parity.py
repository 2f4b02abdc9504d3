"""Greedy output on real weights (``smollm2``, SmolLM2-135M-Instruct) equals transformers' own
`generate(do_sample=False)` token for token, through every regime that changes which tokens
share a forward pass: a small token budget (chunked prefill), a small KV pool (preemption and
recompute) and a shared system prompt (blocks served from the prefix cache).

Random weights have wide margins between the first and second token; real weights have
near-ties, where summing the same float32 products in another order (a batch of eight instead of
one, a prompt in chunks) can flip the argmax. Such a flip is allowed only where transformers' own
logits put the two tokens less than `NEAR_TIE` apart, the engine picked the runner-up, and it is
the run's only divergence: every other prompt is equal token for token.
"""

from __future__ import annotations

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import BatchResult, greedy_requests, run_batch
from vconsole.shared.config import EngineConfig
from vconsole.tools.prompts import ENGINEER, TUTOR, ChatPrompt, ChatRenderer

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
NEAR_TIE = 1e-4
# Five questions behind one system prompt (the prefix cache serves its blocks), two behind
# another, one alone (the template's default system prompt).
PROMPTS = [
    *(ChatPrompt(TUTOR, q) for q in ("What is the capital of France?", "Why is the sky blue?",
                                     "Explain what a prime number is.",
                                     "How do plants make their food?",
                                     "Solve for x: 3x + 5 = 20.")),
    ChatPrompt(ENGINEER, "How do I reverse a list in Python?"),
    ChatPrompt(ENGINEER, "What is a race condition?"),
    ChatPrompt(None, "Give me a simple recipe for pancakes."),
]


class Reference:
    """transformers' greedy continuation of one prompt and, per step, the gap between its two
    highest logits."""

    def __init__(self, tokens: list[int], gaps: list[float], runners_up: list[int]) -> None:
        self.tokens, self.gaps, self.runners_up = tokens, gaps, runners_up


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    chat = ChatRenderer(AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True))
    return [chat.ids(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompt_ids) -> list[Reference]:
    """One batched `generate` call, the prompts left-padded (the attention mask keeps the pads
    out): a quarter of the time of one call per prompt on two cores, and the same tokens and
    top-2 gaps (to 1e-4) when measured."""
    width = max(map(len, prompt_ids))
    pad = smollm2_hf.generation_config.pad_token_id or 0
    x = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    with torch.inference_mode():
        y = smollm2_hf.generate(x, attention_mask=mask, do_sample=False,
                                max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack(y.logits, dim=1).topk(2, dim=-1)          # [prompt, step, 2]
    gaps = top2.values[..., 0] - top2.values[..., 1]
    return [Reference(y.sequences[i, width:].tolist(), gaps[i].tolist(),
                      top2.indices[i, :, 1].tolist()) for i in range(len(prompt_ids))]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    """One engine for the module: every regime at once. 32 tokens a step cuts the ~40-token
    prompts of four running requests into chunks; 10 blocks of 16 tokens hold about two whole
    requests, so the others are preempted and recomputed; a system prompt's first block is
    cached for the next request that starts with it."""
    return EngineCore(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32",
                                   max_num_batched_tokens=32, num_kv_blocks=10, block_size=16,
                                   max_num_seqs=4))


def divergences(result: BatchResult, reference: list[Reference]) -> list[tuple[int, int]]:
    """(prompt, first differing step) of each prompt whose tokens differ from the reference."""
    return [(i, next(k for k, (a, b) in enumerate(zip(got, ref.tokens, strict=True))
                     if a != b))
            for i, (got, ref) in enumerate(zip(result.output_token_ids, reference, strict=True))
            if got != ref.tokens]


def assert_equal_but_near_ties(result: BatchResult, reference: list[Reference]) -> None:
    assert all(len(t) == MAX_TOKENS for t in result.output_token_ids)
    found = divergences(result, reference)
    lines = [f"prompt {i} ({PROMPTS[i].user!r}) step {k}: top-2 gap {reference[i].gaps[k]:.2e}, "
             f"engine {result.output_token_ids[i][k]}, reference {reference[i].tokens[k]}, "
             f"runner-up {reference[i].runners_up[k]}" for i, k in found]
    assert len(found) <= 1, "more than one prompt diverged:\n" + "\n".join(lines)
    for (i, k), line in zip(found, lines, strict=True):   # a float32 near-tie, broken the other way
        ref = reference[i]
        assert ref.gaps[k] < NEAR_TIE and result.output_token_ids[i][k] == ref.runners_up[k], line


def test_the_reference_answers_the_question(smollm2_dir, reference):
    """The weights are the real model's: the first prompt's greedy answer names Paris."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert "Paris" in tok.decode(reference[0].tokens)


def test_greedy_equals_transformers_through_chunks_preemption_and_the_prefix_cache(
        engine, prompt_ids, reference):
    requests = greedy_requests(engine, prompt_ids, MAX_TOKENS, ignore_eos=True)
    result = run_batch(engine, requests)
    assert result.num_preemptions > 0
    assert result.prefix_hits > 0
    assert any(o.num_cached_tokens > 0 for o in result.outputs)
    assert result.num_steps > sum(len(p) for p in prompt_ids) // 32   # prefills were chunked
    assert_equal_but_near_ties(result, reference)
