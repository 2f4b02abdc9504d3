"""The throughput bench's FLOP count (`vconsole.tools.bench.flops`): the parameters it counts are
the model's own, and a request's useful FLOPs are the same however the engine splits its steps."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vconsole.engine.worker.tiny_model import SMALL_GQA_LLAMA
from vconsole.tools.bench.flops import ModelShape, matmul_peak_flops


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL_GQA_LLAMA))


def test_the_counted_matmul_weights_are_the_models_linears(model):
    shape = ModelShape.of(model.config)
    linears = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name != "lm_head")
    assert shape.layer_matmul_params == linears
    assert shape.lm_head_params == model.lm_head.weight.numel()
    # Everything else is the embedding table and the norms: no matmul there.
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert sum(p.numel() for p in model.parameters()) == \
        shape.layer_matmul_params + 2 * shape.lm_head_params + norms


def test_attention_counts_every_key_each_query_sees():
    shape = ModelShape(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate=128, vocab=100)
    for start, n in [(0, 1), (0, 7), (5, 1), (13, 9)]:
        keys = sum(p + 1 for p in range(start, start + n))
        assert shape.attention_flops(start, n) == 4 * 2 * 4 * 16 * keys


@pytest.mark.parametrize("chunks", [[40], [16, 16, 8], [1] * 40])
def test_a_request_costs_the_same_however_its_prefill_is_chunked(chunks):
    shape = ModelShape(num_layers=30, hidden=576, num_heads=9, num_kv_heads=3, head_dim=64,
                       intermediate=1536, vocab=49_152)
    prompt, output = sum(chunks), 12
    total, start = 0, 0
    for i, n in enumerate(chunks):   # only the chunk that ends the prompt samples
        total += shape.step_flops({"r": start}, {"r": n}, 1 if i == len(chunks) - 1 else 0)
        start += n
    for _ in range(output - 1):      # every output but the last is fed back
        total += shape.step_flops({"r": start}, {"r": 1}, 1)
        start += 1
    assert total == shape.request_flops(prompt, output)


def test_the_peak_is_a_plausible_float32_rate():
    peak = matmul_peak_flops(size=256, repeats=2)
    assert 1e8 < peak < 1e14
