"""``--quantization int4``: a float model's linears quantized at load into GGUF blocks and run on
the gguf kernels (`int4_weights`, issue #47).

On every vector path this CPU can run: a quantized linear's weights lie within the scheme's
rounding bound of the float weights (Q4_1: half a step of its group; Q4_0: a whole step at the
clamped end; Q8_0: half a step; plus the float16 scale's rounding), and its output within the
bound those weights give of the float linear's. A float GGUF served with int4 holds the very
blocks of the same file quantized by the ``gguf`` package and served as stored (``gguf``):
the same tokens. Refused: int4 off CPU, on weights not float32, on a GGUF already quantized.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.worker.test_gguf_linear import SUM_RTOL
from tests.support.cxx import HAVE_CXX
from vconsole.engine.worker import gguf_linear, int4_weights
from vconsole.engine.worker.gguf_linear import SUPPORTED, GGUFLinear

F16_REL = 2.0 ** -11        # float16's rounding of a scale or minimum, relative


def scheme_bound(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """How far each quantized weight may lie from ``w`` ((N, K) float64), by its group of 32:
    the scheme's rounding plus the float16 rounding of the group's scale (and minimum)."""
    g = w.reshape(w.shape[0], -1, 32)
    if type_name == "Q4_1":                     # 16 levels from min to max
        lo, hi = g.min(-1, keepdim=True).values, g.max(-1, keepdim=True).values
        d = (hi - lo) / 15
        bound = d / 2 + 15 * d * F16_REL + lo.abs() * F16_REL
    elif type_name == "Q4_0":   # -8..7 steps of max/8: the other sign's end is clamped a step
        d = g.abs().max(-1, keepdim=True).values / 8
        bound = d + 8 * d * F16_REL
    else:                                        # Q8_0: -127..127 steps of absmax/127
        d = g.abs().max(-1, keepdim=True).values / 127
        bound = d / 2 + 127 * d * F16_REL
    return (bound * (1 + 1e-6) + 1e-12).expand_as(g).reshape(w.shape)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (4, 33, 512), (9, 70, 256), (130, 37, 512)])
def test_a_quantized_linear_is_within_its_schemes_bound(path_kernel, type_name, m, n, k):
    """1-4 rows run the GEMV, more the GEMM; weights with an outlier per row (the groups'
    scales differ 10x), as trained weights have."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[torch.arange(n), torch.randint(0, k, (n,), generator=gen)] *= 10
    bias = torch.randn(n, generator=gen)
    lin = GGUFLinear(int4_weights.quantize_blocks(w, type_name), SUPPORTED[type_name], k, bias)
    w64 = w.double()
    bound = scheme_bound(w64, type_name)
    err = (lin.dequantized_weight().double() - w64).abs()
    assert (err <= bound).all()
    assert err.max() > bound.max() / 100        # rounded, not stored exactly
    x = torch.randn(m, k, generator=gen) * 2
    got = lin(x).double()
    want = x.double() @ w64.t() + bias.double()
    # the weights' rounding, summed against |x|, and the kernels' float32 sums
    limit = x.double().abs() @ bound.t() + SUM_RTOL * (x.double().abs() @ w64.abs().t()) + 1e-6
    assert ((got - want).abs() <= limit).all()


def test_the_model_keeps_a_linear_no_group_fits_and_unties_the_head():
    """tiny's MLP is 688 wide (not a multiple of 32): its down projections stay float; the
    decoder's other linears are Q4_1, the LM head Q8_0, the input embedding float."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the gguf kernels are not available")
    from vconsole.engine.worker.model_loader import load_model

    model = load_model("tiny", "cpu", "float32")[0]
    embed = model.get_input_embeddings().weight.detach().clone()
    summary = int4_weights.quantize_model(model)
    assert summary.replaced == {"Q4_1": 24, "Q8_0": 1} and summary.kept_float == 4
    assert summary.describe().startswith("int4 · 24 Q4_1, 1 Q8_0, 4 float on the gguf kernels")
    assert isinstance(model.get_output_embeddings(), GGUFLinear)
    assert model.get_output_embeddings().type_name == "Q8_0"
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert model.config.tie_word_embeddings is False


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VCONSOLE_CACHE", str(root))
        yield root


def _as_int4(name: str, weight: np.ndarray):
    """write_gguf's encode: the blocks int4 makes of each linear (the head Q8_0)."""
    import gguf

    kind = int4_weights.HEAD_TYPE if name == "output.weight" else int4_weights.INT4_TYPE
    if name == "token_embd.weight":
        return None
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.quantize(weight, qtype), qtype


@pytest.mark.slow
def test_a_float_gguf_under_int4_is_the_same_file_quantized_and_served_as_stored(tmp_path,
                                                                                cache):
    """The same float weights twice: quantized at load (int4) and quantized by the gguf
    package into a file served as stored (gguf). Same blocks (q and k rows in transformers'
    order both ways), the fused decoder on both, the same greedy tokens; int4 is refused for
    the quantized file, off CPU and on bfloat16 weights."""
    from tests.engine.worker.test_gguf_model import MAX_TOKENS, TEXTS, write_gguf
    from vconsole.engine.core import EngineCore
    from vconsole.engine.offline import greedy_requests, run_batch
    from vconsole.engine.worker import weight_format
    from vconsole.shared.config import EngineConfig

    gguf_linear.use_kernel(None)
    (tmp_path / "f").mkdir()
    (tmp_path / "q").mkdir()
    floats = write_gguf(tmp_path / "f" / "m.gguf", "llama", seed=1, hidden=128, ffn=256)
    quant = write_gguf(tmp_path / "q" / "m.gguf", "llama", seed=1, hidden=128, ffn=256,
                       encode=_as_int4)
    int4 = EngineCore(EngineConfig(model=str(floats), device="cpu", quantization="int4"))
    assert int4.runner.weights is not None and int4.runner.weights.startswith(
        "int4 · 14 Q4_1, 1 Q8_0 on the gguf kernels · ")
    assert int4.runner.forward_path == "fused"
    assert 0.6 < int4.model_dims()["weight_bytes"] < 1.1
    stored = EngineCore(EngineConfig(model=str(quant), device="cpu"))
    assert stored.runner.weights is not None and stored.runner.weights.startswith("gguf · ")
    mine = {n: m for n, m in int4.runner.model.named_modules() if isinstance(m, GGUFLinear)}
    theirs = {n: m for n, m in stored.runner.model.named_modules() if isinstance(m, GGUFLinear)}
    assert mine.keys() == theirs.keys() and len(mine) >= 7
    for name, lin in mine.items():
        assert lin.qtype == theirs[name].qtype and torch.equal(lin.blocks, theirs[name].blocks)
    ids = [list(int4.tokenizer(t, add_special_tokens=False).input_ids) for t in TEXTS]
    got = run_batch(int4, greedy_requests(int4, ids, MAX_TOKENS, ignore_eos=True))
    want = run_batch(stored, greedy_requests(stored, ids, MAX_TOKENS, ignore_eos=True))
    assert got.output_token_ids == want.output_token_ids

    with pytest.raises(ValueError, match=r"int4 quantizes a float model; m\.gguf is already "
                                         r"quantized \(Q4_1, Q8_0\): run its blocks as stored "
                                         r"with --quantization gguf"):
        EngineCore(EngineConfig(model=str(quant), device="cpu", quantization="int4"))
    with pytest.raises(ValueError, match="int4 runs on CPU float32 weights"):
        EngineCore(EngineConfig(model=str(floats), device="cpu", dtype="bfloat16",
                                quantization="int4"))
    model = int4.runner.model
    with pytest.raises(ValueError, match="int4 runs on CPU only"):
        weight_format.apply(model, EngineConfig(model=str(floats), quantization="int4"), "cuda")
    # bench quality --quantization int4 quantizes a quantized GGUF's float conversion
    from vconsole.engine.worker.gguf_model import ensure_converted
    from vconsole.tools.bench.quality import float_model

    assert float_model(str(quant)) == str(ensure_converted(quant))
    assert float_model(str(floats)) == str(floats) and float_model("tiny") == "tiny"
