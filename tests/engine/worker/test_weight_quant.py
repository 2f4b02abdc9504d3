"""Int8 weights (`weight_quant`, ``--quantization int8``): the linear's error stays inside the
bound its per-channel weight scale and its path's activations allow (bfloat16, or int8 blocks of
32 on the kernel), packing for the kernel keeps the int8 values, fusing int8 linears is exact,
and an int8 engine runs its own fused forward (not transformers'), generates, and on each path
gives logits as close to the float32 engine's as the bfloat16 path does."""

from __future__ import annotations

import pytest
import torch

from tests.support.cxx import HAVE_CXX
from tests.support.int8_bound import int8_linear_bound
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import attention_kernel, weight_quant
from vconsole.engine.worker.model_runner import FORWARD_ENV
from vconsole.engine.worker.tiny_model import ensure_tiny_model
from vconsole.engine.worker.weight_quant import Int8Linear, ManyRowsPath, SliceOf
from vconsole.shared.config import EngineConfig, validate_config

pytestmark = pytest.mark.skipif(not weight_quant.available(),
                                reason="this torch has no _weight_int8pack_mm")


LOGITS_SLACK = 2.0    # the kernel path's logits error over the bf16 path's, at most


def _linear(k: int, n: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 3.0, n)[:, None])  # scales differ per channel
    return lin


def test_quantized_weight_is_within_half_a_step_of_the_float_one():
    lin = _linear(96, 40)
    q, scale = weight_quant.quantize_weight(lin.weight)
    assert q.dtype == torch.int8 and q.abs().max() <= weight_quant.QMAX
    err = (q.float() * scale[:, None] - lin.weight).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


def _kernel_path() -> ManyRowsPath:
    """The kernel's best path here (skips without a compiler)."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: int8 weights take the bfloat16 path")
    kernel = attention_kernel.build()
    return ManyRowsPath(weight_quant.kernel_paths(kernel)[0], kernel.int8_gemm)


@pytest.fixture(params=["bf16", "kernel"])
def each_path(request):
    """Each way an int8 linear multiplies, set for this process, then forgotten."""
    weight_quant.use_path(ManyRowsPath("bf16") if request.param == "bf16" else _kernel_path())
    yield weight_quant.many_rows_path()
    weight_quant.use_path(None)


@pytest.fixture
def bf16_path():
    weight_quant.use_path(ManyRowsPath("bf16"))
    yield
    weight_quant.use_path(None)


@pytest.mark.parametrize("rows", [1, weight_quant.SMALL_ROWS, 64])
def test_int8_linear_error_is_bounded_by_its_scales(rows, each_path):
    """Per output ``n``: half a weight step on every product, ``s[n]/2 * |x|_1``, plus the
    path's activations: bfloat16's roundings (the input, the scale and the output, each within
    2^-9 relative; 2^-8 allowed: ``2^-8 * (|x| @ |W_q s|^T + |y|)``), or the kernel's int8
    blocks (``a[b] / 2`` on each input of block ``b``) and float32 rounding
    (`tests.support.int8_bound`). Both bfloat16 kernels (few rows and many, the latter in
    chunks) and the int8 kernel stay inside it."""
    lin = _linear(256, 72)
    qlin = Int8Linear.from_linear(lin)
    torch.manual_seed(1)
    x = torch.randn(rows, 256) * 2
    with torch.no_grad():
        want = lin(x)
    got = qlin(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    q, s_w = qlin.int8_weight()
    bound = int8_linear_bound(q, s_w, x, want, each_path.name)
    assert ((got - want).abs() <= bound).all()
    # And it is far from vacuous: the typical error is a small share of the bound.
    assert (got - want).abs().mean() < 0.2 * bound.mean()


@pytest.mark.parametrize("layout", ["u8", "s8"])
def test_packing_for_the_kernel_keeps_the_int8_values(layout):
    """Panels of 16 channels, K in groups of 4, padded to whole panels and blocks of 32."""
    q = torch.randint(-127, 128, (37, 70), dtype=torch.int8)
    packed = weight_quant.pack(q, layout)
    assert packed.shape == (3, 96 // 4, 16, 4) and packed.dtype == torch.int8
    assert torch.equal(weight_quant.unpack(packed, 37, 70, layout), q)
    g, c, t = 5, 3, 2                                    # panel 1: channel 19, k 22
    value = int(packed[1, g, c, t])
    want = int(q[16 + c, 4 * g + t])
    assert (value ^ 0x80 if layout == "u8" else value) & 0xFF == want & 0xFF


def test_the_chunked_many_rows_path_covers_every_output(monkeypatch, bf16_path):
    """Above SMALL_ROWS the weight is converted a chunk of rows at a time: chunks that do not
    divide the outputs give the same result as one chunk."""
    qlin = Int8Linear.from_linear(_linear(64, 50))
    x = torch.randn(9, 64)
    whole = qlin(x)
    monkeypatch.setattr(qlin, "_chunk_rows", 7)
    torch.testing.assert_close(qlin(x), whole, rtol=0, atol=0)


def test_concatenated_int8_linears_give_the_parts_side_by_side(each_path):
    parts = [Int8Linear.from_linear(_linear(64, n, seed=n)) for n in (16, 8, 8)]
    parts[0](torch.randn(2, 64))        # on the kernel path: packed before being concatenated
    fused = Int8Linear.concat(parts)
    assert (fused.in_features, fused.out_features) == (64, 32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1),
                               rtol=0, atol=1e-6)
    sliced = SliceOf(fused, 16, 24)
    torch.testing.assert_close(sliced(x), parts[1](x), rtol=0, atol=1e-6)


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="int8"):
        weight_quant.quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int4")
    with pytest.raises(ValueError, match="int8"):
        validate_config({"quantization": "int3"})


def _int8_engine(model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                   quantization="int8", num_kv_blocks=64))


@pytest.mark.slow
def test_an_int8_engine_runs_the_fused_forward_and_generates(tmp_path):
    core = _int8_engine(ensure_tiny_model(tmp_path))
    runner = core.runner
    assert runner.forward_path == "fused"
    assert isinstance(runner.model.get_output_embeddings(), Int8Linear)   # the LM head too
    layer = runner.model.get_decoder().layers[0]
    assert isinstance(layer.self_attn.q_proj, SliceOf)                    # one int8 copy
    assert isinstance(layer.self_attn.o_proj, Int8Linear)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    res = run_batch(core, greedy_requests(core, prompts, 12, ignore_eos=True))
    assert [len(t) for t in res.output_token_ids] == [12, 12]


@pytest.mark.slow
def test_int8_fused_and_transformers_forwards_agree(tmp_path, monkeypatch):
    """transformers' own forward over the int8 modules (q/k/v as slices of the fused matmul)
    computes what the fused decoder computes: the same int8 products, to float rounding."""
    model_dir = ensure_tiny_model(tmp_path)
    logits = {}
    for path in ("fused", "transformers"):
        if path == "transformers":
            monkeypatch.setenv(FORWARD_ENV, "transformers")
        core = _int8_engine(model_dir)
        assert core.runner.forward_path == path
        for req in greedy_requests(core, [list(range(30, 70)), [3, 4, 5]], 1):
            assert core.add_request(req) is None
        logits[path] = core.runner.compute_logits(core.scheduler.schedule())
    assert logits["fused"].keys() == logits["transformers"].keys() and logits["fused"]
    for rid, row in logits["fused"].items():
        torch.testing.assert_close(row, logits["transformers"][rid], rtol=1e-3, atol=1e-3)


def _prompt_logits(core: EngineCore) -> dict[str, torch.Tensor]:
    """The next-token logits after a 40-token and a 3-token prompt, one step."""
    for req in greedy_requests(core, [list(range(30, 70)), [3, 4, 5]], 1):
        assert core.add_request(req) is None
    return core.runner.compute_logits(core.scheduler.schedule())


@pytest.mark.slow
def test_on_the_kernel_an_int8_engine_is_as_close_to_float32_as_on_bfloat16(tmp_path):
    """The int8 kernel's activation blocks cost the engine no more than bfloat16 activations
    do: per prompt, its logits' largest distance from the float32 engine's is within
    `LOGITS_SLACK` times the bf16 path's, and the greedy token is the float32 one."""
    model_dir = ensure_tiny_model(tmp_path)
    want = _prompt_logits(EngineCore(EngineConfig(model=str(model_dir), device="cpu",
                                                  dtype="float32", num_kv_blocks=64)))
    got = {}
    try:
        for name, path in (("bf16", ManyRowsPath("bf16")), ("kernel", _kernel_path())):
            weight_quant.use_path(path)
            got[name] = _prompt_logits(_int8_engine(model_dir))
    finally:
        weight_quant.use_path(None)
    assert got["kernel"].keys() == got["bf16"].keys() == want.keys() and want
    for rid, ref in want.items():
        err = {name: (rows[rid] - ref).abs().max().item() for name, rows in got.items()}
        assert 0 < err["kernel"] <= LOGITS_SLACK * err["bf16"], err
        assert int(got["kernel"][rid].argmax()) == int(ref.argmax())


def test_the_shared_scratch_made_inside_inference_mode_serves_a_forward_outside_it(monkeypatch,
                                                                                  bf16_path):
    """The engine's steps run under inference mode and make the shared bfloat16 scratch; a
    later forward outside it (a test, a benchmark's reference) must still write into it."""
    monkeypatch.setattr(weight_quant, "_scratch", {})
    lin = Int8Linear.from_linear(torch.nn.Linear(32, 48))
    x = torch.randn(weight_quant.SMALL_ROWS + 3, 32)
    with torch.inference_mode():
        inside = lin(x)
    with torch.no_grad():
        outside = lin(x)
    assert torch.equal(inside, outside)


def test_a_kernel_path_asked_for_by_name_is_refused_when_the_kernel_cannot_be_built(monkeypatch):
    """`VCONSOLE_INT8_GEMM=kernel` (or a path's name) where no kernel builds (no compiler) is an
    error naming it; only ``auto`` falls back to the bf16 path, saying why."""
    from vconsole.engine.worker import attention_kernel

    def no_compiler(*_a: object, **_k: object) -> None:
        raise RuntimeError("no C++ compiler (c++ not found)")

    monkeypatch.setattr(attention_kernel, "build", no_compiler)
    monkeypatch.setattr(weight_quant, "native_bf16", lambda *_a: False)
    for wanted in ("kernel", "avx2"):
        monkeypatch.setenv(weight_quant.PATH_ENV, wanted)
        with pytest.raises(ValueError, match=f"{weight_quant.PATH_ENV}={wanted}: the int8 kernel"):
            weight_quant._choose_path()
    monkeypatch.setenv(weight_quant.PATH_ENV, "auto")
    fallback = weight_quant._choose_path()
    assert fallback.name == "bf16" and "unavailable" in fallback.why
