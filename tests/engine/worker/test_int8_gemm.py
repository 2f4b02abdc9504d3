"""The int8 weights' kernel (``csrc/int8_gemm.cpp``, issue #49): every path it has (AVX-512
VNNI, 256-bit VNNI, AVX2's sign trick, generic C++), in each build this CPU can run (native,
and with -mno-avx512f as an AVX2 machine compiles it), computes exactly its scheme (activations
quantized in blocks of 32, integer sums) and so stays within the scheme's bound of the float
reference; an `Int8Linear` on each path stays within its bound of the float linear; the path is
chosen by what the CPU has, can be forced, is refused where the CPU lacks it, and is named."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from tests.support.cxx import HAVE_CXX
from tests.support.int8_bound import activation_error, int8_linear_bound, quantize_rows
from vconsole.engine.worker import attention_kernel, weight_quant
from vconsole.engine.worker.weight_quant import (
    BLOCK,
    KERNEL_PATHS,
    Int8Linear,
    ManyRowsPath,
    kernel_paths,
    layout_of,
    pack,
)

pytestmark = pytest.mark.skipif(not weight_quant.available(),
                                reason="this torch has no _weight_int8pack_mm")

# Each build as the extra flags that make this CPU's compiler take it, and the CPU flag the
# build needs to differ from the native one (the attention kernel's tests build the same).
BUILDS = {"native": ((), None), "no-avx512": (("-mno-avx512f",), "avx512f")}


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: int8 weights take the bfloat16 path")
    extra, needs = BUILDS[request.param]
    if needs is not None and (platform.machine() != "x86_64"
                              or needs not in weight_quant.cpu_flags()):
        pytest.skip(f"the native build takes this path here (no {needs})")
    return request.param, attention_kernel.build(extra)


@pytest.fixture(params=KERNEL_PATHS)
def path(request, build):
    """(kernel, path name) for each path the build holds; the others are skipped."""
    _, kernel = build
    if request.param not in kernel_paths(kernel):
        pytest.skip(f"this build or CPU has no {request.param} path")
    return kernel, request.param


@pytest.fixture
def restore_path():
    yield
    weight_quant.use_path(None)


def test_each_build_lists_the_paths_this_cpu_runs(build):
    name, kernel = build
    flags = weight_quant.cpu_flags()
    want = weight_quant.cpu_kernel_paths(flags)
    if name == "no-avx512":         # 256-bit VNNI only by its own flag; AVX-512 ones gone
        want = [p for p in want if p != "avx512-vnni" and (p != "avx-vnni" or "avx_vnni" in flags)]
    assert kernel_paths(kernel) == want
    assert kernel_paths(kernel)[-1] == "generic"
    isa = "avx512" if name == "native" and "avx512f" in flags else \
        "avx2" if "avx2" in flags else "generic"
    assert kernel.int8_gemm_isa() == isa


def _run(kernel, path: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], q.shape[0]), float("nan"))
    kernel.int8_gemm(x, pack(q, layout_of(path)), s, out, path)
    return out


def _case(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(m, k) * 3
    x[:, ::7] *= 20                     # outlier channels, as a down projection's input has
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) * 0.1 + 1e-3
    return x, q, s


# Rows that fill no micro-kernel (4 rows at 512 bits, 2 at 256), channels that fill no panel
# (16) or chunk (3 panels), K not a multiple of the block, SmolLM2's shapes.
SHAPES = [(1, 8, 5), (2, 64, 16), (3, 100, 33), (5, 64, 48), (6, 96, 70), (13, 200, 40),
          (64, 576, 960), (9, 1536, 576)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_each_path_computes_its_scheme_exactly(path, m, k, n):
    """The same blocks of quantized activations (computed here in the kernel's float32 steps),
    their integer sums exact, the block and channel scales in float32: equal to the float64
    value of the scheme within float32's rounding of K/32 block sums (1e-5 of the
    magnitudes)."""
    kernel, name = path
    x, q, s = _case(m, k, n, seed=m * 1000 + n)
    got = _run(kernel, name, x, q, s)
    xq, a = quantize_rows(x)
    blocks = -(-k // BLOCK)
    qd = torch.nn.functional.pad(q.double(), (0, blocks * BLOCK - k)).view(n, blocks, BLOCK)
    xqd = torch.nn.functional.pad(xq, (0, blocks * BLOCK - k)).view(m, blocks, BLOCK)
    sums = torch.einsum("mbk,nbk->mnb", xqd, qd)              # exact in float64
    want = (sums * a.double()[:, None, :]).sum(-1) * s.double()
    magnitudes = (torch.einsum("mbk,nbk->mnb", xqd.abs(), qd.abs())
                  * a.double()[:, None, :]).sum(-1) * s.double()
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= 1e-5 * magnitudes + 1e-6).all()


@pytest.mark.parametrize("m,k,n", SHAPES[::2])
def test_each_path_is_within_the_schemes_bound_of_the_float_product(path, m, k, n):
    """Against ``x @ (q s)^T`` with x unquantized: the activations' block rounding
    (`activation_error`) and float rounding; and the bound is not vacuous."""
    kernel, name = path
    x, q, s = _case(m, k, n, seed=7 * m + n)
    got = _run(kernel, name, x, q, s).double()
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.t()
    bound = activation_error(x, q, s) + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6
    assert ((got - ref).abs() <= bound).all()
    assert (got - ref).abs().mean() < 0.5 * bound.mean()


def test_the_paths_agree_and_a_zero_row_gives_zeros(build):
    _, kernel = build
    x, q, s = _case(11, 320, 70, seed=5)
    x[4] = 0
    outs = {p: _run(kernel, p, x, q, s) for p in kernel_paths(kernel)}
    first = next(iter(outs.values()))
    assert (first[4] == 0).all()
    for out in outs.values():
        torch.testing.assert_close(out, first, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_handle(build):
    _, kernel = build
    x, q, s = torch.randn(6, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    w, out = pack(q, "u8"), torch.empty(6, 8)
    with pytest.raises(RuntimeError, match="float32 x, int8 packed"):
        kernel.int8_gemm(x.double(), w, s, out, "generic")
    with pytest.raises(RuntimeError, match="packed weights must be"):
        kernel.int8_gemm(torch.randn(6, 96), w, s, out, "generic")
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.int8_gemm(torch.randn(64, 6).t(), w, s, out, "generic")
    with pytest.raises(RuntimeError, match="'avx9' is not in this build"):
        kernel.int8_gemm(x, w, s, out, "avx9")


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_an_int8_linear_on_each_path_stays_within_its_bound(path, rows, restore_path):
    kernel, name = path
    torch.manual_seed(3)
    lin = torch.nn.Linear(192, 72)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 3.0, 72)[:, None])
    qlin = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 192) * 2
    with torch.no_grad():
        want = lin(x)
    q, s = qlin.int8_weight()
    weight_quant.use_path(ManyRowsPath(name, kernel.int8_gemm))
    got = qlin(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    bound = int8_linear_bound(q, s, x, want, name)
    assert ((got - want).abs() <= bound).all()
    # packed for the kernel, one copy: the int8 values it unpacks are the stored ones
    assert qlin._layout == layout_of(name)
    assert torch.equal(qlin.int8_weight()[0], q)
    # and back on the bfloat16 path the same linear is within that path's bound
    weight_quant.use_path(ManyRowsPath("bf16"))
    got_bf16 = qlin(x)
    assert ((got_bf16 - want).abs() <= int8_linear_bound(q, s, x, want, "bf16")).all()
    assert qlin._layout == "plain"


def test_the_path_follows_the_cpu_and_can_be_forced(monkeypatch, restore_path):
    assert weight_quant.native_bf16({"avx2", "avx512_bf16"})
    assert weight_quant.native_bf16({"amx_bf16"})
    assert not weight_quant.native_bf16({"avx2", "fma", "avx512f"})
    assert weight_quant.cpu_kernel_paths({"avx2", "avx512f", "avx512bw", "avx512_vnni",
                                          "avx512vl"}) == list(KERNEL_PATHS)
    assert weight_quant.cpu_kernel_paths({"avx2", "fma"}) == ["avx2", "generic"]
    assert weight_quant.cpu_kernel_paths({"avx2", "avx_vnni"}) == ["avx-vnni", "avx2",
                                                                   "generic"]
    assert weight_quant.cpu_kernel_paths(set()) == ["generic"]
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
    # a kernel path this CPU lacks is refused, never run
    monkeypatch.setenv(weight_quant.PATH_ENV, "avx512-vnni")
    with pytest.raises(ValueError, match="runs only avx2, generic"):
        weight_quant.predicted_path({"avx2", "fma"})


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_without_native_bf16_the_best_kernel_path_is_chosen_and_named(monkeypatch,
                                                                      restore_path):
    monkeypatch.setattr(weight_quant, "native_bf16", lambda flags=None: False)
    monkeypatch.setenv(weight_quant.PATH_ENV, "auto")
    weight_quant.use_path(None)
    path = weight_quant.many_rows_path()
    best = kernel_paths(attention_kernel.build())[0]
    assert path.gemm is not None and not path.slow
    assert path.describe() == f"int8 · {best}"
    assert weight_quant.predicted_path().name == best
    monkeypatch.setenv(weight_quant.PATH_ENV, "generic")     # forced by name
    weight_quant.use_path(None)
    assert weight_quant.many_rows_path().describe() == "int8 · generic"


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


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler")
def test_the_generic_path_is_announced_with_its_cost(restore_path, caplog):
    weight_quant.use_path(ManyRowsPath("generic", attention_kernel.build().int8_gemm))
    with caplog.at_level(logging.INFO, logger=weight_quant.__name__):
        weight_quant.quantize_model(torch.nn.Sequential(torch.nn.Linear(16, 8)), "int8")
    assert "int8 · generic" in caplog.text and weight_quant.GENERIC_COST in caplog.text
