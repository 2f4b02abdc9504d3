"""The built-in ``small-gqa`` model (8 layers x 512 hidden, 4 query heads per KV head): chosen by
name like ``tiny``, and the engine's greedy output equals transformers' own `generate` token for
token when many requests of mixed lengths share its forward passes (several decode groups,
chunked prefill)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker.model_loader import resolve_model_path
from vconsole.shared.config import EngineConfig

pytestmark = pytest.mark.slow  # builds a 27M-parameter model and compares with HF

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("vconsole-cache")
        mp.setenv("VCONSOLE_CACHE", str(root))
        yield root


def test_small_gqa_by_name_matches_hf_generate(cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("small-gqa")
    assert path.parent == cache and path.name.startswith("small-gqa-")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 90))] for _ in range(16)]
    core = EngineCore(EngineConfig(model="small-gqa", device="cpu", dtype="float32",
                                   max_num_seqs=16, max_num_batched_tokens=256))
    info = core.runner.info
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (8, 512, 8, 2)
    result = run_batch(core, greedy_requests(core, prompts, MAX_TOKENS))
    assert result.num_steps > sum(len(p) for p in prompts) // 256  # prefill was chunked

    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                               dtype=torch.float32).eval()
    with torch.inference_mode():
        for ids, got in zip(prompts, result.output_token_ids, strict=True):
            x = torch.tensor([ids])
            want = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=MAX_TOKENS)
            assert got == want[0, len(ids):].tolist(), f"prompt of {len(ids)} tokens diverged"


def test_an_unknown_name_is_a_clear_error(cache: Path) -> None:
    with pytest.raises(ValueError, match="built-in model: 'tiny', 'small-gqa', 'smollm2'"):
        resolve_model_path("small-gqb")
