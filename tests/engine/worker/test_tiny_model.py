"""The built-in tiny model and the loader: built once, reused, loadable like any HF model dir."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from vconsole.engine.worker import model_loader
from vconsole.engine.worker.tiny_model import EOS_ID, PAD_ID, ensure_tiny_model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vconsole-cache")


# Building the model takes seconds: the tests that need it are marked slow.
@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> Path:
    return ensure_tiny_model(cache_dir)


@pytest.mark.slow
def test_tiny_model_is_reused(cache_dir: Path, tiny: Path) -> None:
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(cache_dir) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny.name.startswith("tiny-")
    assert [p.name for p in cache_dir.iterdir()] == [tiny.name]  # no temp dirs left behind


@pytest.mark.slow
def test_cache_dir_comes_from_env(tiny: Path, cache_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VCONSOLE_CACHE", str(cache_dir))
    assert ensure_tiny_model() == tiny


@pytest.mark.slow
def test_other_seed_is_another_model(cache_dir: Path, tiny: Path) -> None:
    other = ensure_tiny_model(cache_dir, seed=1)
    assert other != tiny
    from safetensors.torch import load_file
    a, b = load_file(tiny / "model.safetensors"), load_file(other / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[key], b[key])


@pytest.mark.slow
def test_loadable_by_stock_transformers(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 4, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert model.generation_config.eos_token_id == EOS_ID
    assert model.generation_config.pad_token_id == PAD_ID
    tok = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == PAD_ID
    text = "Hello, wörld! ✓"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode())         # one token per byte
    assert ids[0] == 3 + ord("H")
    assert tok.decode(ids) == text
    assert max(ids) < cfg.vocab_size


@pytest.mark.slow
def test_concurrent_builders_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert sorted(os.listdir(tmp_path)) == [results[0].name]
    assert (results[0] / "model.safetensors").is_file()


@pytest.mark.slow
def test_load_model_uses_paged_attention(tiny: Path) -> None:
    model, tok, info = model_loader.load_model(str(tiny), "cpu", "auto")
    assert model.config._attn_implementation == "vconsole_paged"
    assert info.dtype == "float32" and info.device == "cpu"
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (4, 2, 64)
    assert info.eos_token_ids == (EOS_ID,)
    assert not model.training


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2") as err:
        model_loader.load_model(str(tmp_path), "cpu", "auto")
    for name in ("Llama", "Qwen2", "Mistral"):
        assert name in str(err.value)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        model_loader.load_model(str(tmp_path / "nope"), "cpu", "auto")


def test_device_and_dtype_resolution() -> None:
    cpu = torch.device("cpu")
    assert model_loader.resolve_dtype("auto", cpu) == torch.float32
    assert model_loader.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert model_loader.resolve_dtype("float16", cpu) == torch.float16
    assert model_loader.resolve_device("cpu") == cpu
    with pytest.raises(ValueError):
        model_loader.resolve_dtype("int8", cpu)
    if not torch.cuda.is_available():
        assert model_loader.resolve_device("auto") == cpu
        with pytest.raises(ValueError, match="CUDA"):
            model_loader.resolve_device("cuda")
