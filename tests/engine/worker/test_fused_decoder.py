"""`FusedDecoder`, the engine's own Llama-family forward (fused q/k/v and gate/up, RoPE on q and k
at once, the paged attention called directly), against transformers' own model.

The tiny and small-gqa Llamas are covered by the engine's correctness tests (they run this path);
here: a Qwen2 (biases on q/k/v, sliding-window layers beside full ones) and a Mistral (a sliding
window on every layer), random weights saved with the built-in byte tokenizer and loaded through
``from_pretrained`` like any local directory, with prompts longer than the window; the weights
are not copied; and transformers' forward (``VCONSOLE_FORWARD=transformers``) gives the same
logits on the same runner.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from support.local_models import mistral_config, qwen2_config, save_random_model
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker.model_runner import FORWARD_ENV
from vconsole.engine.worker.tiny_model import ensure_tiny_model
from vconsole.shared.config import EngineConfig

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
WINDOW = 24
@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    cfg = qwen2_config(WINDOW)
    assert cfg.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return save_random_model(tmp_path_factory.mktemp("qwen2"), cfg)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("mistral"), mistral_config(WINDOW))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Short ones and ones several windows long; a small token budget chunks the long prefills.
    return [[rng.randrange(3, 250) for _ in range(rng.choice([3, 17, 40, 75, 110]))]
            for _ in range(12)]


def _engine(model_dir: Path, **cfg) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                   max_num_seqs=12, max_num_batched_tokens=96, **cfg))


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                               dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=MAX_TOKENS)
            out.append(y[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("which", ["qwen2", "mistral"])
def test_greedy_tokens_equal_transformers_generate(which, qwen2_dir, mistral_dir):
    model_dir = qwen2_dir if which == "qwen2" else mistral_dir
    prompts = _prompts(11)
    core = _engine(model_dir)
    assert core.runner.forward_path == "fused"
    result = run_batch(core, greedy_requests(core, prompts, MAX_TOKENS))
    assert result.num_steps > 12  # chunked prefills and decodes shared the steps
    for ids, got, want in zip(prompts, result.output_token_ids, _reference(model_dir, prompts),
                              strict=True):
        assert got == want, f"{which}: a prompt of {len(ids)} tokens diverged"


def test_qwen2_keeps_its_biases_and_windows(qwen2_dir):
    core = _engine(qwen2_dir)
    fused = core.runner.fused_decoder
    assert fused is not None
    assert all(layer.qkv_b is not None for layer in fused.layers)
    assert [layer.sliding_window for layer in fused.layers] == [None, None, WINDOW, WINDOW]


def test_the_fused_weights_are_transformers_weights_not_copies(tmp_path):
    core = EngineCore(EngineConfig(model=str(ensure_tiny_model(tmp_path)), device="cpu",
                                   dtype="float32"))
    runner = core.runner
    layer = runner.fused_decoder.layers[0]
    attn = runner.model.get_decoder().layers[0].self_attn
    mlp = runner.model.get_decoder().layers[0].mlp
    qkv = layer.qkv_w.untyped_storage().data_ptr()
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == qkv
    gate_up = layer.gate_up_w.untyped_storage().data_ptr()
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == gate_up
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up
    # q, k, v in order: the fused rows are the separate weights.
    h = attn.q_proj.out_features
    assert torch.equal(layer.qkv_w[:h], attn.q_proj.weight)
    assert torch.equal(layer.qkv_w[h:h + attn.k_proj.out_features], attn.k_proj.weight)


def test_transformers_forward_gives_the_same_logits(qwen2_dir, monkeypatch):
    """Both forwards on one prompt set, through compute_logits (which writes the pool the same
    way): float32 logits agree to rounding, so greedy argmax agrees."""
    prompts = _prompts(12)[:6]
    logits = {}
    for path in ("fused", "transformers"):
        if path == "transformers":
            monkeypatch.setenv(FORWARD_ENV, "transformers")
        core = _engine(qwen2_dir)
        assert core.runner.forward_path == path
        for req in greedy_requests(core, prompts, 1):
            assert core.add_request(req) is None
        so = core.scheduler.schedule()
        logits[path] = core.runner.compute_logits(so)
    assert logits["fused"].keys() == logits["transformers"].keys() and logits["fused"]
    for rid, row in logits["fused"].items():
        other = logits["transformers"][rid]
        torch.testing.assert_close(row, other, rtol=1e-4, atol=1e-4)
        assert int(row.argmax()) == int(other.argmax())
