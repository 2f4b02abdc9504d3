"""The int8 weights' many-rows GEMM (``csrc/int8_gemm.cpp``, issue #49): on each vector path
this CPU can run (AVX-512 natively here, AVX2 forced with ``-mno-avx512f``) it equals the float
reference ``x @ (q s)^T`` to float rounding; an `Int8Linear` on each many-rows path (the kernel,
bfloat16) stays within its scheme's bound of the float linear; the path is chosen by what the
CPU has, can be forced, and is named; the emulated bfloat16 path is never taken silently."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from tests.support.cxx import HAVE_CXX
from vconsole.engine.worker import attention_kernel, weight_quant
from vconsole.engine.worker.weight_quant import Int8Linear, ManyRowsPath

pytestmark = pytest.mark.skipif(not weight_quant.available(),
                                reason="this torch has no _weight_int8pack_mm")

# Each vector path as the extra flags that make this CPU's build take it, the CPU flag the
# path needs to differ from the native build, and the name the build reports.
PATHS = {"native": ((), None), "avx2": (("-mno-avx512f",), "avx512f")}


@pytest.fixture(scope="module", params=list(PATHS))
def gemm_kernel(request):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: int8 weights take the bfloat16 path")
    extra, needs = PATHS[request.param]
    if needs is not None and (platform.machine() != "x86_64"
                              or needs not in weight_quant.cpu_flags()):
        pytest.skip(f"the native build takes this path here (no {needs})")
    return attention_kernel.build(extra)


@pytest.fixture
def restore_path():
    yield
    weight_quant.use_path(None)


def _expected_isa(extra_removed_avx512: bool) -> str:
    flags = weight_quant.cpu_flags()
    if "avx512f" in flags and not extra_removed_avx512:
        return "avx512"
    return "avx2" if "avx2" in flags else "generic"


def test_each_build_names_its_vector_path(gemm_kernel):
    forced_avx2 = gemm_kernel.library != attention_kernel.build().library
    assert gemm_kernel.int8_gemm_isa() == _expected_isa(forced_avx2)


@pytest.mark.parametrize("m,k,n", [(1, 8, 5), (5, 64, 32), (6, 64, 33), (13, 100, 70),
                                   (64, 576, 960), (97, 96, 40)])
def test_equals_the_float_reference_to_rounding(gemm_kernel, m, k, n):
    """Rows and channels that fill no whole micro-kernel or panel, and SmolLM2's qkv shape.
    Float32 sums of k products: within k * 2^-23 of the magnitude sum, 1e-5 allowed."""
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k) * 3
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) * 0.1 + 1e-3
    out = torch.full((m, n), float("nan"))
    gemm_kernel.int8_gemm(x, q, s, out)
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.t()
    bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-7
    assert ((out.double() - ref).abs() <= bound).all()


def test_refuses_what_it_does_not_handle(gemm_kernel):
    x, q, s = torch.randn(6, 16), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8)
    out = torch.empty(6, 8)
    with pytest.raises(RuntimeError, match="float32 x, int8 q"):
        gemm_kernel.int8_gemm(x.double(), q, s, out)
    with pytest.raises(RuntimeError, match="x has 16 columns, q 15"):
        gemm_kernel.int8_gemm(x, q[:, :15].contiguous(), s, out)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemm_kernel.int8_gemm(x.t(), q, s, out)


def _bound(lin: torch.nn.Linear, qlin: Int8Linear, x: torch.Tensor, want: torch.Tensor,
           rounding: float) -> torch.Tensor:
    """Half a weight step on every product, ``s[n]/2 * |x|_1``, plus the kernels' rounding
    relative to the magnitudes."""
    q, s = qlin.int8_weight()
    stored = q.float() * s[:, None]
    return (s[None, :] / 2 * x.abs().sum(1, keepdim=True)
            + rounding * (x.abs() @ stored.abs().t() + want.abs()))


@pytest.mark.parametrize("rows", [5, 64])
def test_an_int8_linear_on_each_many_rows_path_stays_within_its_bound(gemm_kernel, rows,
                                                                      restore_path):
    torch.manual_seed(3)
    lin = torch.nn.Linear(192, 72)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 3.0, 72)[:, None])
    qlin = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 192) * 2
    with torch.no_grad():
        want = lin(x)
    weight_quant.use_path(ManyRowsPath(gemm_kernel.int8_gemm_isa(), gemm_kernel.int8_gemm))
    got_kernel = qlin(x)
    weight_quant.use_path(ManyRowsPath("bf16"))
    got_bf16 = qlin(x)
    assert got_kernel.shape == want.shape == got_bf16.shape
    # float32 activations: only the weights' error and float rounding
    assert ((got_kernel - want).abs() <= _bound(lin, qlin, x, want, 1e-5) + 1e-6).all()
    # bfloat16 activations, scales and products: 2^-8 relative on top
    assert ((got_bf16 - want).abs() <= _bound(lin, qlin, x, want, 2 ** -8) + 1e-5).all()
    # the kernel path is exactly the stored int8 weights, to float rounding
    stored = qlin.dequantized_weight()
    torch.testing.assert_close(got_kernel, x @ stored.t() + lin.bias.detach(), rtol=1e-5,
                               atol=1e-4)


def test_the_path_follows_the_cpu_and_can_be_forced(monkeypatch, restore_path):
    assert weight_quant.native_bf16({"avx2", "avx512_bf16"})
    assert weight_quant.native_bf16({"amx_bf16"})
    assert not weight_quant.native_bf16({"avx2", "fma", "avx512f"})
    monkeypatch.setenv(weight_quant.PATH_ENV, "bf16")
    weight_quant.use_path(None)
    assert weight_quant.many_rows_path().name == "bf16"
    monkeypatch.setattr(weight_quant, "native_bf16", lambda flags=None: True)
    monkeypatch.setenv(weight_quant.PATH_ENV, "auto")
    weight_quant.use_path(None)
    assert weight_quant.many_rows_path().describe() == "int8 · bf16"
    monkeypatch.setenv(weight_quant.PATH_ENV, "sideways")
    weight_quant.use_path(None)
    with pytest.raises(ValueError, match="auto, kernel or bf16"):
        weight_quant.many_rows_path()


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_without_native_bf16_the_kernel_is_chosen_and_named(monkeypatch, restore_path):
    monkeypatch.setattr(weight_quant, "native_bf16", lambda flags=None: False)
    monkeypatch.setenv(weight_quant.PATH_ENV, "auto")
    weight_quant.use_path(None)
    path = weight_quant.many_rows_path()
    assert path.gemm is not None and not path.slow
    assert path.describe() == f"int8 · {_expected_isa(False)}"


def test_an_emulated_bf16_path_is_announced_with_its_cost(monkeypatch, restore_path, caplog):
    monkeypatch.setattr(weight_quant, "native_bf16", lambda flags=None: False)
    monkeypatch.setenv(weight_quant.PATH_ENV, "bf16")
    weight_quant.use_path(None)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with caplog.at_level(logging.INFO, logger=weight_quant.__name__):
        assert weight_quant.quantize_model(model, "int8") == 1
    text = caplog.text
    assert "int8 · bf16 (emulated bfloat16: slow)" in text
    assert "emulates" in text and weight_quant.EMULATED_BF16_COST in text
