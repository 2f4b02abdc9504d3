"""``--model file.gguf``: a GGUF file (or a directory holding one) is converted once into a plain
model directory and runs through the engine exactly as transformers reads the same file; a file
the engine cannot run is one clear ValueError, and `vconsole generate` says it in one line.

The files are written here with the ``gguf`` package: two-layer Llama and Qwen2 models with
random float32 weights and a byte-level BPE vocabulary in the file itself (259 symbols and a few
merges, ChatML's special tokens marked as control tokens, a chat template), the way llama.cpp's
converter writes a Llama-3 or Qwen2 GGUF and transformers' GGUF loader reads it back
(``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre`` naming the split regex).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vconsole.cli import build_parser
from vconsole.commands import generate as generate_cmd
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import gguf_model
from vconsole.engine.worker.model_loader import resolve_model_path
from vconsole.shared.config import EngineConfig

pytestmark = pytest.mark.slow

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("a", "t")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2"}
TEXTS = ["the cat sat on the mat", "in the winter there are stars", "hello"]
MAX_TOKENS = 12


def write_gguf(path: Path, arch: str, *, seed: int = 0, hidden: int = 128, layers: int = 2,
               heads: int = 2, kv_heads: int = 1, ffn: int = 256,
               encode: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
               ) -> Path:
    """A tiny GGUF of architecture ``arch`` (llama, qwen2: with q/k/v biases) at ``path``.
    ``encode(name, weight)``: a 2-D weight's stored bytes and GGML type (None: float32)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]
    head_dim = hidden // heads

    def weight(*shape: int, std: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    add_tensor = w.add_tensor

    def add(name: str, array: np.ndarray) -> None:
        stored = encode(name, array) if encode is not None and array.ndim == 2 else None
        if stored is None:
            add_tensor(name, array)
        else:
            add_tensor(name, stored[0], raw_dtype=stored[1])
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER.get(arch, "default"))
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)
    add("token_embd.weight", weight(len(tokens), hidden))
    add("output_norm.weight", np.ones(hidden, np.float32))
    # logits spread wide: greedy choices by clear margins, not by float rounding
    add("output.weight", weight(len(tokens), hidden, std=1.0))
    for i in range(layers):
        blk = f"blk.{i}."
        add(blk + "attn_norm.weight", np.ones(hidden, np.float32))
        add(blk + "attn_q.weight", weight(heads * head_dim, hidden))
        add(blk + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        add(blk + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        if arch == "qwen2":
            add(blk + "attn_q.bias", weight(heads * head_dim))
            add(blk + "attn_k.bias", weight(kv_heads * head_dim))
            add(blk + "attn_v.bias", weight(kv_heads * head_dim))
        add(blk + "attn_output.weight", weight(hidden, heads * head_dim))
        add(blk + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(blk + "ffn_gate.weight", weight(ffn, hidden))
        add(blk + "ffn_up.weight", weight(ffn, hidden))
        add(blk + "ffn_down.weight", weight(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A conversion cache of the module's own ($VCONSOLE_CACHE), not the user's."""
    root = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VCONSOLE_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, cache) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ggufs")
    out = {}
    for arch in ("llama", "qwen2"):
        (d / arch).mkdir()
        # seed 1: every greedy step of TEXTS wins by >= 0.08 in the logits (seed 0 had a step
        # won by 6e-4, near enough to a float32 tie to flip on another CPU)
        out[arch] = write_gguf(d / arch / f"tiny-{arch}.gguf", arch, seed=1)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_generates_through_the_engine_as_transformers_reads_the_file(ggufs, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ggufs[arch]
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert core.runner.info.model_type == arch
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = [list(core.tokenizer(t, add_special_tokens=False).input_ids) for t in TEXTS]
    assert ids == [list(ref_tok(t, add_special_tokens=False).input_ids) for t in TEXTS]
    assert [core.tokenizer.decode(i) for i in ids] == TEXTS     # the vocabulary came along
    assert len(ids[0]) < len(TEXTS[0])                          # ... and its merges
    chat = core.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                              tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    result = run_batch(core, greedy_requests(core, ids, MAX_TOKENS, ignore_eos=True))

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, got in zip(ids, result.output_token_ids, strict=True):
            x = torch.tensor([prompt])
            y = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=MAX_TOKENS, eos_token_id=None)
            assert got == y[0, len(prompt):].tolist()


def test_a_directory_holding_one_gguf_is_that_model(ggufs):
    path = ggufs["llama"]
    assert resolve_model_path(path.parent) == resolve_model_path(path)


def test_a_converted_gguf_is_reused_not_converted_again(ggufs, caplog):
    path = ggufs["qwen2"]
    target = resolve_model_path(path)                 # converted by now (or here)
    stamps = {p.name: p.stat().st_mtime_ns for p in [target, *target.iterdir()]}
    caplog.clear()          # the first call may have converted (and said so): not this one
    with caplog.at_level(logging.WARNING, logger=gguf_model.__name__):
        again = resolve_model_path(str(path))
    assert again == target
    assert gguf_model.CONVERTING not in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in [target, *target.iterdir()]} == stamps
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")
            and p.is_dir()] == []                     # no temporary directory left behind


def test_a_conversion_reads_the_file_once_and_says_how_far_it_is(tmp_path, monkeypatch):
    """The metadata (the vocabulary, in Python) is parsed once, not once by the check and
    once each for transformers' config, weights and tokenizer; the conversion names its step
    every `PROGRESS_S` (here 20 ms) and its time at the end; the result is as before."""
    import gguf

    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", seed=1, layers=6)
    opened: list[str] = []
    real_reader = gguf.GGUFReader

    def counting_reader(*args, **kwargs):
        opened.append(str(args[0]))
        return real_reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    monkeypatch.setattr(gguf_model, "PROGRESS_S", 0.02)
    lines: list[str] = []
    target = gguf_model.ensure_converted(path, tmp_path / "cache", say=lines.append)
    assert opened == [str(path.resolve())]
    assert gguf.GGUFReader is counting_reader          # put back as it was
    assert len(lines) > 1 and lines[-1].startswith("converted in ")
    assert all(re.fullmatch(r"converting the GGUF model: .+, \d+ s so far", line)
               for line in lines[:-1]), lines
    tensors = 3 + 9 * 6
    steps = [line for line in lines if "dequantizing tensor" in line]
    assert all(f" of {tensors}, " in line for line in steps), steps
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32)
    assert len(opened) == 3         # transformers alone: one for the config, one for weights
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def _bad_models(tmp_path: Path, ggufs: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Each kind of file the engine cannot run, with the words its error must say."""
    whole = ggufs["llama"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[:len(whole) * 2 // 3])   # an interrupted download
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is a text file, not a model\n")
    gpt2 = tmp_path / "gpt2.gguf"
    w = __import__("gguf").GGUFWriter(str(gpt2), "gpt2")
    w.add_name("tiny-gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(whole)
    return {"truncated": (truncated, "is not a readable GGUF file"),
            "not a GGUF": (not_gguf, "is not a GGUF file"),
            "gpt2": (gpt2, "is a GGUF of architecture 'gpt2'; the engine runs llama"),
            "two GGUFs": (two, "holds several GGUF files (a.gguf, b.gguf); pass one")}


def test_a_file_the_engine_cannot_run_is_one_clear_error(tmp_path, ggufs):
    for path, words in _bad_models(tmp_path, ggufs).values():
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            resolve_model_path(path)
    left = [p.name for p in (Path(os.environ["VCONSOLE_CACHE"]) / "models").iterdir()]
    assert not [n for n in left if any(w in n for w in ("truncated", "notes", "gpt2"))], left


@pytest.mark.parametrize("kind", ["truncated", "gpt2"])
def test_vconsole_generate_with_a_bad_gguf_says_so_in_one_line(tmp_path, ggufs, capsys, kind):
    path, words = _bad_models(tmp_path, ggufs)[kind]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    args = build_parser().parse_args(["generate", "--model", str(path), "--input",
                                      str(tmp_path / "in.jsonl"), "--output",
                                      str(tmp_path / "out.jsonl"), "--no-progress"])
    assert generate_cmd.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vconsole generate: cannot start: ")
    assert words in err and "Traceback" not in err


def test_a_files_hash_is_remembered_until_the_file_changes(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    cache = tmp_path / "cache"
    first = gguf_model.file_hash(path, cache)
    assert first == hashlib.sha256(path.read_bytes()).hexdigest()
    (memo,) = (cache / "models" / ".hashes").iterdir()
    memo.write_text("f" * 64)                          # what the memo says is what is used
    assert gguf_model.file_hash(path, cache) == "f" * 64
    path.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)   # same size, new content
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert gguf_model.file_hash(path, cache) == \
        hashlib.sha256(path.read_bytes()).hexdigest() != first
