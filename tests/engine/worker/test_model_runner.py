"""The model runner with real forward passes: paged attention equals HF's own attention."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from support.scheduling import Chunk, RunnerFeed
from vconsole.engine.request import Request
from vconsole.engine.sched.output import SchedulerOutput
from vconsole.engine.worker.model_runner import ModelRunner
from vconsole.engine.worker.tiny_model import EOS_ID, build_byte_tokenizer, ensure_tiny_model
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow  # real forward passes compared with HF

BLOCK = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VCONSOLE_CACHE", str(tmp_path_factory.mktemp("vconsole-cache")))
        yield ensure_tiny_model()


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> ModelRunner:
    r = ModelRunner(EngineConfig(model=str(tiny_dir), device="cpu", block_size=BLOCK,
                                 num_kv_blocks=NUM_BLOCKS))
    r.allocate_kv_cache(r.determine_num_blocks(), BLOCK)
    return r


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()


def ref_last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def prompt_of(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 259) for _ in range(n)]


def shuffled_blocks(n: int, seed: int, pool: int = NUM_BLOCKS) -> list[int]:
    ids = list(range(pool))
    random.Random(seed).shuffle(ids)
    return ids[:n]


def step(req: Request, start: int, end: int, blocks: list[int], sample: bool) -> Chunk:
    """Feed ``start .. end-1``; ``sample`` states what the runner must infer (the end reaches
    the request's last token)."""
    assert sample == (end == req.num_tokens)
    return req, start, end, blocks


def logits_of(runner: ModelRunner, *chunks: Chunk,
              feed: RunnerFeed | None = None) -> dict[str, torch.Tensor]:
    """Without a ``feed`` every request is sent whole (the runner forgets it first)."""
    so = feed(*chunks) if feed else RunnerFeed()(*chunks, fresh=True)
    return runner.compute_logits(so)


def execute(runner: ModelRunner, *chunks: Chunk, feed: RunnerFeed | None = None):
    return runner.execute_model(feed(*chunks) if feed else RunnerFeed()(*chunks, fresh=True))


def test_chunked_prefill_over_shuffled_blocks_matches_hf(runner: ModelRunner,
                                                          reference: Any) -> None:
    prompt = prompt_of(41, seed=1)
    req = Request("a", prompt, SamplingParams())
    blocks = shuffled_blocks(11, seed=2)
    assert blocks != sorted(blocks)
    for lo, hi in ((0, 13), (13, 30), (30, 41)):
        got = logits_of(runner, step(req, lo, hi, blocks, sample=hi == 41))
    want = ref_last_logits(reference, prompt)
    assert (got["a"] - want).abs().max() < 1e-4
    assert got["a"].argmax() == want.argmax()


def test_decode_after_prefill_matches_hf(runner: ModelRunner, reference: Any) -> None:
    prompt = prompt_of(9, seed=3)
    req = Request("d", prompt, SamplingParams())
    blocks = shuffled_blocks(4, seed=4)
    logits_of(runner, step(req, 0, 9, blocks, sample=True))
    for tok in (17, 200, 5):
        req.output_token_ids.append(tok)
        n = req.num_tokens
        got = logits_of(runner, step(req, n - 1, n, blocks, sample=True))["d"]
        assert (got - ref_last_logits(reference, req.all_token_ids)).abs().max() < 1e-4


def test_prefill_and_decode_in_one_forward_equal_each_alone(runner: ModelRunner,
                                                           reference: Any) -> None:
    a = Request("a", prompt_of(22, seed=5), SamplingParams())
    b = Request("b", prompt_of(13, seed=6), SamplingParams())
    a_blocks, b_blocks = shuffled_blocks(14, seed=7)[:6], shuffled_blocks(14, seed=7)[6:]
    logits_of(runner, step(a, 0, 10, a_blocks, False), step(b, 0, 13, b_blocks, True))
    b.output_token_ids.append(42)
    # Writes are idempotent (same tokens, same slots), so the three runs see the same pool.
    a_alone = logits_of(runner, step(a, 10, 22, a_blocks, True))["a"]
    b_alone = logits_of(runner, step(b, 13, 14, b_blocks, True))["b"]
    both = logits_of(runner, step(b, 13, 14, b_blocks, True), step(a, 10, 22, a_blocks, True))
    assert (both["a"] - a_alone).abs().max() < 1e-5
    assert (both["b"] - b_alone).abs().max() < 1e-5
    assert (both["a"] - ref_last_logits(reference, a.all_token_ids)).abs().max() < 1e-4
    assert (both["b"] - ref_last_logits(reference, b.all_token_ids)).abs().max() < 1e-4


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new: int,
                    chunk: int = 1 << 30) -> list[list[int]]:
    """A miniature scheduler: prefill in chunks of ``chunk`` tokens, decode until eos or
    ``max_new``; every request gets blocks from a shuffled free list."""
    free = shuffled_blocks(NUM_BLOCKS, seed=8)
    feed = RunnerFeed()  # whole the first time, only the new token after that
    reqs, tables = [], {}
    for i, p in enumerate(prompts):
        r = Request(str(i), p, SamplingParams(max_tokens=max_new), eos_token_id=EOS_ID)
        need = -(-(len(p) + max_new) // BLOCK)
        tables[r.request_id], free = free[:need], free[need:]
        reqs.append(r)
    running = list(reqs)
    while running:
        chunks = []
        for r in running:
            end = min(r.num_tokens, r.num_computed_tokens + chunk)
            chunks.append(step(r, r.num_computed_tokens, end, tables[r.request_id],
                               end == r.num_tokens))
        out = execute(runner, *chunks, feed=feed)
        assert set(out.sampled) == {r.request_id for r, _, end, _ in chunks
                                    if end == r.num_tokens}
        for r, _, end, _ in chunks:
            r.num_computed_tokens = end
            if end == r.num_tokens:
                r.output_token_ids.append(out.sampled[r.request_id])
        running = [r for r in running if len(r.output_token_ids) < max_new
                   and not (r.output_token_ids and r.output_token_ids[-1] == EOS_ID)]
    return [r.output_token_ids for r in reqs]


def test_greedy_loop_reproduces_hf_generate(runner: ModelRunner, reference: Any) -> None:
    prompts = [prompt_of(n, seed=10 + n) for n in (1, 6, 17, 33)]
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                     dtype=torch.long), do_sample=False, max_new_tokens=20)
            want.append(out[0, len(p):].tolist())
    assert greedy_generate(runner, prompts, 20) == want
    assert greedy_generate(runner, prompts, 20, chunk=7) == want
    assert len({tuple(w) for w in want}) == len(want)


def test_pool_changes_exactly_in_the_written_slots(runner: ModelRunner) -> None:
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    req = Request("w", prompt_of(7, seed=20), SamplingParams())
    blocks = shuffled_blocks(3, seed=21)
    other = Request("x", prompt_of(5, seed=22), SamplingParams())
    execute(runner, step(req, 0, 7, blocks[:2], True), step(other, 4, 5, blocks[1:], True))
    written = {blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(7)}
    written.add(blocks[2] * BLOCK)  # position 4 of "x" lives at offset 0 of its second block
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) == written
            assert new.flatten(0, 1)[sorted(written)].abs().sum(-1).min() > 0


def test_only_do_sample_rows_are_sampled_and_empty_is_empty(runner: ModelRunner) -> None:
    assert runner.execute_model(SchedulerOutput()).sampled == {}
    a = Request("a", prompt_of(8, seed=30), SamplingParams())
    b = Request("b", prompt_of(8, seed=31), SamplingParams())
    blocks = shuffled_blocks(4, seed=32)
    out = execute(runner, step(a, 0, 4, blocks[:2], False), step(b, 0, 8, blocks[2:], True))
    assert list(out.sampled) == ["b"] and 0 <= out.sampled["b"] < runner.vocab_size
    assert execute(runner, step(a, 4, 6, blocks[:2], False)).sampled == {}


def test_seeded_sampling_is_independent_of_batch(runner: ModelRunner) -> None:
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=12)
    prompt = prompt_of(11, seed=40)

    def run(with_neighbours: bool) -> list[int]:
        r = Request("s", list(prompt), params)
        blocks = shuffled_blocks(8, seed=41)
        extra = [Request(f"n{i}", prompt_of(5 + i, seed=50 + i),
                         SamplingParams(temperature=0.8)) for i in range(3)]
        feed = RunnerFeed()
        for _ in range(12):
            chunks = [step(r, r.num_computed_tokens, r.num_tokens, blocks[:6], True)]
            if with_neighbours:
                chunks += [step(e, 0, e.num_tokens, [blocks[6 + i % 2]] * 8, True)
                           for i, e in enumerate(extra[:2])]
            out = execute(runner, *chunks, feed=feed if not with_neighbours else None)
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(out.sampled["s"])
        return r.output_token_ids

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 3


def test_memory_sizing(runner: ModelRunner, tiny_dir: Path) -> None:
    per_block = runner.kv_cache_bytes_per_block(16)
    assert per_block == 2 * 4 * 16 * 2 * 64 * 4
    assert runner.determine_num_blocks() == NUM_BLOCKS
    runner.config = runner.config.replace(num_kv_blocks=None, cpu_kv_cache_gib=0.01,
                                          block_size=16)
    try:
        assert runner.determine_num_blocks() == int(0.01 * (1 << 30)) // per_block
    finally:
        runner.config = runner.config.replace(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    assert runner.max_model_len == 2048
    assert runner.eos_token_id == EOS_ID and runner.vocab_size == 259
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (NUM_BLOCKS, BLOCK, 2, 64)


def _save_random(config: Any, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["qwen2", "mistral-sliding"])
def test_other_architectures_match_hf(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    common = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, eos_token_id=EOS_ID, pad_token_id=0)
    if arch == "qwen2":
        cfg = Qwen2Config(**common)
    else:
        cfg = MistralConfig(**common, sliding_window=6)
    path = _save_random(cfg, tmp_path / arch)
    r = ModelRunner(EngineConfig(model=str(path), device="cpu", block_size=BLOCK,
                                 num_kv_blocks=32))
    r.allocate_kv_cache(32, BLOCK)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    req = Request("q", prompt_of(19, seed=60), SamplingParams())
    blocks = shuffled_blocks(8, seed=61, pool=32)
    logits_of(r, step(req, 0, 8, blocks, False))
    got = logits_of(r, step(req, 8, 19, blocks, True))["q"]
    assert (got - ref_last_logits(ref, req.all_token_ids)).abs().max() < 1e-4
    for tok in (9, 99):
        req.output_token_ids.append(tok)
        got = logits_of(r, step(req, req.num_tokens - 1, req.num_tokens, blocks, True))["q"]
        assert (got - ref_last_logits(ref, req.all_token_ids)).abs().max() < 1e-4


def test_a_budget_below_zero_is_no_blocks_not_a_division_by_zero(runner: ModelRunner) -> None:
    """A negative budget (a GPU whose memory others hold): a negative count, which the caller
    turns into "no memory left for the KV cache" (it once divided by zero staging entries;
    since #48's kv3 nothing is set aside beside the blocks)."""
    assert runner.kv_staging_bytes == 0
    assert runner._blocks_in(-1000, 64) < 0
