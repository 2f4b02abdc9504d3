"""Small random-weight Llamas, built locally, so the engine runs and is tested without a hub.

`ensure_model(name)` writes an ordinary Hugging Face model directory (config, safetensors
weights, generation config, tokenizer) for one of the built-in configs in `MODEL_CONFIGS`:
``tiny`` (4 layers x 256 hidden, the default everywhere) and ``small-gqa`` (8 layers x 512
hidden, 8 query heads over 2 KV heads, for benchmarks at a less trivial size). ``--model NAME``
then loads it through exactly the same `from_pretrained` path as any real model directory:
nothing downstream knows it is special.

Invariants:
- The directory name carries a hash of everything that determines its contents (config, seed,
  tokenizer layout, format version), so a changed recipe never reuses a stale model.
- A directory that exists under that name is complete: it is written to a temporary sibling and
  moved into place with one ``os.replace``, so concurrent processes (tests start engine
  subprocesses) either see nothing or the whole model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

_FORMAT_VERSION = 2   # 2: the tokenizer has a chat template
_BUILD_LOCK = threading.Lock()  # weight init uses torch's global RNG: one build per process
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2; the 256 byte symbols follow
# A small chat template so `vconsole serve`'s /v1/chat/completions works with the built-in
# models: each message as "<|role|>\ncontent</s>\n", then "<|assistant|>\n" to answer. No BOS:
# what it renders is exactly the prompt.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": len(SPECIAL_TOKENS) + 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: two query heads per KV head
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # Larger than Llama's 0.02 so logits are spread out and greedy argmax has clear margins
    # instead of being decided by float rounding.
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

# 8 layers x 512 hidden, GQA with 4 query heads per KV head: ~27M parameters, the shape of a
# small real model's layer (head_dim 64), still quick to build and to run on a CPU.
SMALL_GQA_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    # Deeper and wider than tiny: a smaller spread keeps the residual stream and the logits in
    # the same range as tiny's, so greedy argmax still has clear margins.
    "initializer_range": 0.06,
}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {"tiny": TINY_LLAMA, "small-gqa": SMALL_GQA_LLAMA}


def default_cache_dir() -> Path:
    """``$VCONSOLE_CACHE`` if set, else ``~/.cache/vconsole``."""
    env = os.environ.get("VCONSOLE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vconsole"


def tiny_model_hash(seed: int = 0, name: str = "tiny") -> str:
    recipe = {"config": MODEL_CONFIGS[name], "seed": seed, "special": SPECIAL_TOKENS,
              "chat_template": CHAT_TEMPLATE, "format": _FORMAT_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def ensure_tiny_model(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the tiny model's directory, building it first if it is not there yet."""
    return ensure_model("tiny", cache_dir, seed)


def ensure_model(name: str, cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the directory of built-in model ``name`` (a key of `MODEL_CONFIGS`), building
    it first if it is not there yet. Raises ValueError for an unknown name."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(MODEL_CONFIGS)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{name}-{tiny_model_hash(seed, name)}"
    if (target / "config.json").is_file():
        return target
    with _BUILD_LOCK:
        if (target / "config.json").is_file():
            return target
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _build(tmp, name, seed)
            try:
                os.replace(tmp, target)
            except OSError:
                # Another process won the race and its complete copy is in place already.
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: Path, name: str, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # callers print JSON; a build must not write to stderr
    config = LlamaConfig(**MODEL_CONFIGS[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID)
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer with no merges: every UTF-8 byte is one token.

    The vocabulary is the three special tokens followed by the 256 symbols of the ByteLevel
    alphabet, so any text round-trips and ids are stable across machines.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_order)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({sym: len(SPECIAL_TOKENS) + i for i, sym in enumerate(byte_symbols)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=TINY_LLAMA[
                                       "max_position_embeddings"], chat_template=CHAT_TEMPLATE)


def _byte_order(symbol: str) -> int:
    """Sort ByteLevel symbols by the byte they stand for, so byte b gets id 3 + b."""
    return _BYTE_OF_SYMBOL[symbol]


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte -> printable character table that the ByteLevel pre-tokenizer uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_SYMBOL = {sym: b for b, sym in _bytes_to_unicode().items()}
