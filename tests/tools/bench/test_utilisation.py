"""Model-FLOP and memory-bandwidth utilisation of a served GGUF (`bench throughput --peer
llama-server`): the shape and step bytes read from the file itself, and each row's arithmetic."""

from __future__ import annotations

import pytest

from vconsole.engine.worker import gguf_model
from vconsole.tools.bench.flops import ModelShape
from vconsole.tools.bench.utilisation import GGUFWeights, gguf_weights, row_utilisation


def test_smollm2_s_shape_and_step_bytes_come_from_its_gguf():
    try:
        path = gguf_model.smollm2_gguf()
    except ValueError as e:                      # the package is an install extra
        pytest.skip(f"no SmolLM2 GGUF here: {e}")
    w = gguf_weights(path)
    assert w.shape == ModelShape(num_layers=30, hidden=576, num_heads=9, num_kv_heads=3,
                                 head_dim=64, intermediate=1536, vocab=49152)
    # 30 blocks of Q4_1 linears (20 bytes per 32 weights) and norms, and the tied Q8_0
    # embedding as the LM head (34 bytes per 32): 96.6 MB, under the float32 540 MB
    head = 576 * 49152 * 34 // 32
    linears = w.shape.layer_matmul_params * 20 // 32
    assert head + linears < w.step_bytes < head + linears + 30 * 2 * 576 * 4 + 1
    assert 96_000_000 < w.step_bytes < 97_000_000


def test_a_row_s_utilisation_is_its_rate_times_its_work_over_the_peaks():
    shape = ModelShape(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate=128, vocab=1000)
    w = GGUFWeights(shape, step_bytes=1_000_000)
    per_token = shape.token_flops() + shape.sample_flops() + shape.attention_flops(100, 1)
    one = row_utilisation({"decode_tokens_per_s": 50.0, "tok_per_s": 40.0}, 1, w, 100,
                          peak_flops=1e9, peak_bytes=1e9)
    assert one == {"mfu": round(50 * per_token / 1e9, 5), "mbu": 0.05}   # 50 steps of 1 MB
    many = row_utilisation({"tok_per_s": 640.0}, 64, w, 100, peak_flops=1e9, peak_bytes=1e9)
    assert many == {"mfu": round(640 * per_token / 1e9, 5), "mbu_at_least": 0.01}
    assert row_utilisation({"tok_per_s": None}, 8, w, 100, 1e9, 1e9) == {
        "mfu": None, "mbu_at_least": None}
