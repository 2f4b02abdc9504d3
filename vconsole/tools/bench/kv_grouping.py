"""`vconsole bench kv-grouping`: which grouping of K/V quantization loses least, measured.

The KV formats (`vconsole.engine.worker.kv_quant`) needed a choice: a scale per token and KV
head (vLLM's ``*_per_token_head``, llama.cpp's ``q8_0`` / ``q4_1`` with one group per head), or
KIVI's keys per channel (a scale per channel over a block of tokens; keys have outlier
channels), symmetric or with a minimum, one group per head or groups of 32. This runs
transformers' own float32 SmolLM2 over the quality yardstick's text (`quality.token_windows`)
with K and V rounded through each scheme right before attention (all keys, the query's own
included: the worst case; the engine's first prefill chunk attends over its unrounded K/V) and
reports the perplexity of each against none, with what tells schemes apart on a short text:
the mean and 99th percentile of the per-token change of the logprob (``token_logprob_diff_*``)
and the perplexity change's own 2-standard-error band (``rel_diff_2se``: a perplexity change
smaller than it is the rounding's luck, not the scheme's). Keys alone and values alone rounded
at 8 bits say which of the two carries the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from vconsole.tools.bench import quality

ATTN = "vconsole_kv_grouping"
KEY_BLOCK = 16   # tokens per key-channel group (the pool's default block size)


def _per_row(x: torch.Tensor, bits: int, asym: bool, group: int | None = None) -> torch.Tensor:
    """Round ``x`` (..., D) with one scale (and minimum) per row, or per ``group`` elements."""
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    if asym:
        lo = x.amin(-1, keepdim=True)
        step = (x.amax(-1, keepdim=True) - lo) / (2 ** bits - 1)
        step = torch.where(step > 0, step, torch.ones_like(step))
        y = torch.round((x - lo) / step).clamp(0, 2 ** bits - 1) * step + lo
    else:
        top = 2 ** (bits - 1) - 1
        step = x.abs().amax(-1, keepdim=True) / top
        step = torch.where(step > 0, step, torch.ones_like(step))
        y = torch.round(x / step).clamp(-top, top) * step
    return y.reshape(shape)


def _per_channel(x: torch.Tensor, bits: int, asym: bool) -> torch.Tensor:
    """KIVI's keys: (B, H, T, D) rounded with one scale per channel over KEY_BLOCK tokens."""
    b, h, t, d = x.shape
    pad = (-t) % KEY_BLOCK
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad), value=0.0) if pad else x
    xb = xp.reshape(b, h, -1, KEY_BLOCK, d).transpose(-1, -2)   # (B, H, T/16, D, 16)
    y = _per_row(xb, bits, asym).transpose(-1, -2).reshape(b, h, t + pad, d)
    return y[:, :, :t]


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def _rotated(x: torch.Tensor, bits: int, asym: bool) -> torch.Tensor:
    """Round ``x`` per row after a Hadamard rotation of each head (outlier channels spread over
    all of them), and rotate back: what attention sees when q and k (and v and the output) are
    rotated alike, since an orthonormal rotation leaves dot products unchanged."""
    h = hadamard(x.shape[-1]).to(x.dtype)
    return _per_row(x @ h, bits, asym) @ h.T


Scheme = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

SCHEMES: dict[str, Scheme | None] = {
    "none": None,
    "int8 per token-head, symmetric (int8_per_token_head)":
        lambda k, v: (_per_row(k, 8, False), _per_row(v, 8, False)),
    "int8 keys per token-head, values exact":
        lambda k, v: (_per_row(k, 8, False), v),
    "int8 values per token-head, keys exact":
        lambda k, v: (k, _per_row(v, 8, False)),
    "int8 keys per channel (KIVI), values per token-head (int8_kivi)":
        lambda k, v: (_per_channel(k, 8, False), _per_row(v, 8, False)),
    "int8 keys per channel (KIVI), each key first staged as int8 per token-head (int8_kivi "
    "with int8 staging: not built)":
        lambda k, v: (_per_channel(_per_row(k, 8, False), 8, False), _per_row(v, 8, False)),
    "int8 groups of 32 (llama.cpp q8_0)":
        lambda k, v: (_per_row(k, 8, False, 32), _per_row(v, 8, False, 32)),
    "int4 per token-head, symmetric":
        lambda k, v: (_per_row(k, 4, False), _per_row(v, 4, False)),
    "int4 per token-head, with minimum (int4_per_token_head)":
        lambda k, v: (_per_row(k, 4, True), _per_row(v, 4, True)),
    "int4 groups of 32, with minimum (llama.cpp q4_1)":
        lambda k, v: (_per_row(k, 4, True, 32), _per_row(v, 4, True, 32)),
    "int4 keys per channel (KIVI), values per token-head, with minimum (int4_kivi)":
        lambda k, v: (_per_channel(k, 4, True), _per_row(v, 4, True)),
    "int4 keys per channel (KIVI), each key first staged as int8 per token-head (int4_kivi, "
    "int8 staging)":
        lambda k, v: (_per_channel(_per_row(k, 8, False), 4, True), _per_row(v, 4, True)),
    "int4 per token-head, symmetric, Hadamard-rotated":
        lambda k, v: (_rotated(k, 4, False), _rotated(v, 4, False)),
    "int4 per token-head, with minimum, Hadamard-rotated":
        lambda k, v: (_rotated(k, 4, True), _rotated(v, 4, True)),
}

_active: dict[str, Scheme | None] = {"scheme": None}


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scheme = _active["scheme"]
    if scheme is not None:
        key, value = scheme(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def kv_grouping_bench(model: str = "smollm2", windows: int = 16, window_tokens: int = 512,
                      log: Callable[[str], None] | None = None,
                      only: list[str] | None = None, text: str = "pydoc") -> dict[str, Any]:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from vconsole.engine.worker.model_loader import resolve_model_path

    say = log or (lambda _m: None)
    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                               dtype=torch.float32).eval()
    AttentionInterface.register(ATTN, _attention)
    ref.set_attn_implementation(ATTN)
    texts = quality.token_windows(tokenizer, windows, window_tokens, text)
    count = windows * (window_tokens - 1)
    rows: list[dict[str, Any]] = []
    base = None
    base_lps: torch.Tensor | None = None
    for name, scheme in SCHEMES.items():
        if only is not None and name != "none" and not any(name.startswith(o) for o in only):
            continue
        say(f"{name}: perplexity over {windows} windows of {window_tokens} tokens")
        _active["scheme"] = scheme
        try:
            lps = torch.cat(quality.reference_window_logprobs(ref, texts)).double()
        finally:
            _active["scheme"] = None
        ppl = quality.perplexity(-float(lps.sum()), count)
        base = ppl if base is None else base
        base_lps = lps if base_lps is None else base_lps
        diff = lps - base_lps
        rows.append({"scheme": name, "ppl": ppl, "rel_diff": ppl / base - 1.0,
                     "rel_diff_2se": 2 * float(diff.std()) / math.sqrt(diff.numel())
                     if diff.numel() > 1 else 0.0,
                     "token_logprob_diff_mean": float(diff.abs().mean()),
                     "token_logprob_diff_p99": float(diff.abs().quantile(0.99))})
    return {"benchmark": "kv-grouping", "model": model, "model_path": str(path),
            "text": quality.TEXT_SOURCES[text], "text_name": text, "windows": windows,
            "window_tokens": window_tokens,
            "key_block_tokens": KEY_BLOCK, "schemes": rows}
