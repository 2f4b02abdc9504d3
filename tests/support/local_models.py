"""Local model directories of other architectures than the built-in Llamas, for tests: random
weights of the tiny model's size, the built-in byte tokenizer (with its chat template), saved with
``save_pretrained`` and loaded back by path like any local Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vconsole.engine.worker.tiny_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_LLAMA,
    build_byte_tokenizer,
)

COMMON = {k: TINY_LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                      "num_attention_heads", "num_key_value_heads",
                                      "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                      "initializer_range", "tie_word_embeddings")}
IDS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def qwen2_config(window: int) -> Any:
    """4 layers, biases on q/k/v; layers 0-1 full attention, 2-3 a sliding window."""
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, **IDS, num_hidden_layers=4, use_sliding_window=True,
                       sliding_window=window, max_window_layers=2)


def mistral_config(window: int) -> Any:
    """3 layers, a sliding window on every one."""
    from transformers import MistralConfig

    return MistralConfig(**COMMON, **IDS, num_hidden_layers=3, sliding_window=window)


def save_random_model(out: Path, config: Any, seed: int = 3) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(**IDS)
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    return out
