"""The runner's CPU linears (`vconsole.engine.worker.cpu_linear`): a packed linear computes what
``nn.Linear`` computes, for every input shape the model feeds it, and packing keeps the module
tree (names, places, biases) that transformers' forward and the profiler's labels rely on."""

from __future__ import annotations

import pytest
import torch

from vconsole.engine.worker import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN")


def test_packed_linear_equals_nn_linear_for_every_input_shape() -> None:
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(96, 40, bias=bias)
        packed = cpu_linear.PackedLinear(lin)
        for x in (torch.randn(1, 7, 96), torch.randn(64, 96), torch.randn(1, 96),
                  torch.randn(0, 96), torch.randn(1, 96, 9).transpose(1, 2)):
            with torch.inference_mode():
                got, want = packed(x), lin(x)
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_each_linear_in_place_and_keeps_the_rest() -> None:
    model = torch.nn.Sequential()
    model.add_module("attn", torch.nn.ModuleDict({"q_proj": torch.nn.Linear(8, 8),
                                                  "norm": torch.nn.LayerNorm(8)}))
    model.add_module("lm_head", torch.nn.Linear(8, 5, bias=False))
    bias = model.attn["q_proj"].bias
    assert cpu_linear.pack_linears(model) == 2
    names = {n: type(m).__name__ for n, m in model.named_modules()}
    assert names["attn.q_proj"] == names["lm_head"] == "PackedLinear"
    assert names["attn.norm"] == "LayerNorm"
    assert model.attn["q_proj"].bias is bias and model.lm_head.bias is None
    assert cpu_linear.pack_linears(model) == 0  # nothing left to pack
