"""Int8 weights (``--quantization int8``): weight-only int8, per-output-channel scales.

Single-stream decode reads every weight once per token: SmolLM2-135M is 540 MB a token in
float32, and at one row a matmul is a memory-bound matrix-vector product. int8 reads a quarter.

The scheme: each weight row ``n`` (an output channel) is stored as ``q[n] = round(W[n] / s[n])``
in [-127, 127] with ``s[n] = max|W[n]| / 127`` (the error of a weight is at most ``s[n] / 2``);
activations are not quantized, only rounded to bfloat16 for the kernels, and every product is
summed in float32. Two kernels, by the step's rows:

- **up to `SMALL_ROWS` rows** (a decode step of a few streams): torch's weight-only int8 matmul
  ``torch._weight_int8pack_mm`` (bfloat16 activations and scales, AVX-512 on CPU): it reads the
  int8 weight once and never materialises a float copy; at one row on the development machine
  2-3x float32 ``F.linear`` (576 x 3072: ~120 us against ~350 us, one thread);
- **more rows** (prefill, wide decode batches, where the matmul is compute-bound and the weight
  is reused by every row), one of two paths, chosen once per process by what the CPU has
  (`many_rows_path`; ``VCONSOLE_INT8_GEMM=kernel|bf16`` forces one):

  - ``bf16``, where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX): the int8 rows
    are converted, `CHUNK_ELEMENTS` at a time, into one shared bfloat16 scratch (int8 values
    are exact in bfloat16) and multiplied with bfloat16 ``torch.mm``, the float32 scales
    applied to the product: 1.5-2x float32 at 64 rows, where ``_weight_int8pack_mm`` is 2x
    slower than float32;
  - the **kernel** (``csrc/int8_gemm.cpp``, built with the attention kernel for this CPU:
    ``avx512``, ``avx2`` or ``generic`` by what the compiler may use) everywhere else: float32
    activations against int8 weight panels widened to float32 in cache, float32 FMAs, the
    scales applied at the end. torch emulates bfloat16 on an AVX2-only CPU, and the ``bf16``
    path there made a loaded engine 3.7x slower than float32 (issue #49); the kernel runs at
    the CPU's float32 FMA rate while reading a quarter of the weight bytes. Without a
    compiler the ``bf16`` path is the fallback, and the start-up line warns when it is
    emulated.

Why not torch's dynamic int8 (``quantized::linear_dynamic``, fbgemm / oneDNN, W8A8 with the
activations quantized per tensor), although it is 4x float32 at one row: measured on SmolLM2
(4 windows x 256 tokens of the quality bench's text), it costs **+68% perplexity** (the MLP's
down projection alone +52%: its input has outlier channels that one per-tensor scale cannot
hold), against **+0.45%** for these int8 weights with float activations and +0.71% with the
activations and scales in bfloat16. ``bench quality --quantization int8`` is the yardstick (goal:
within +1% of float32).

Invariants: only ``torch.nn.Linear`` modules on CPU in float32 are replaced (the decoder layers'
linears and the LM head; the embedding stays float, so a tied LM head becomes an int8 copy);
an `Int8Linear` keeps ``in_features``, ``out_features`` and its float ``bias``; its output is
float32 of the input's shape with the last axis ``out_features``. `Int8Linear.concat` fuses
linears along the output axis exactly (per-channel scales do not change when rows are stacked),
which is how `fused_decoder` builds its qkv and gate/up matmuls.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vconsole.shared.config import QUANTIZATIONS

log = logging.getLogger(__name__)

SMALL_ROWS = 4                 # at most this many rows: _weight_int8pack_mm
CHUNK_ELEMENTS = 1 << 21       # weights converted to bfloat16 at a time above (4 MiB)
QMAX = 127

PATH_ENV = "VCONSOLE_INT8_GEMM"   # auto (default), kernel or bf16: the many-rows path
# What the bf16 path cost where torch emulates bfloat16 (issue #49: a 2-core AVX2 EPYC,
# SmolLM2, 64 concurrent streams over HTTP): said when that path is taken there.
EMULATED_BF16_COST = "3.7x slower than float32 weights at 64 concurrent streams (issue #49)"

_scratch: dict[torch.device, torch.Tensor] = {}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX BF16)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class ManyRowsPath:
    """How steps of more than `SMALL_ROWS` rows multiply: ``name`` is ``bf16`` or the
    kernel's vector path (``avx512``, ``avx2``, ``generic``); ``gemm`` the kernel's operator
    (None for ``bf16``); ``slow`` is set when bfloat16 is emulated here."""

    name: str
    gemm: Callable[..., None] | None = None
    slow: bool = False
    why: str = ""

    def describe(self) -> str:
        return f"int8 · {self.name}" + (" (emulated bfloat16: slow)" if self.slow else "")


_path_lock = threading.Lock()
_path: ManyRowsPath | None = None


def _bf16_path(why: str) -> ManyRowsPath:
    return ManyRowsPath("bf16", None, slow=not native_bf16(), why=why)


def wanted_path() -> str:
    """`PATH_ENV`'s value (``auto`` unset); ValueError naming it when it is none of auto,
    kernel or bf16: the engine's start and `vconsole doctor` refuse the same values."""
    wanted = os.environ.get(PATH_ENV, "auto")
    if wanted not in ("auto", "kernel", "bf16"):
        raise ValueError(f"{PATH_ENV} must be auto, kernel or bf16; got {wanted!r}")
    return wanted


def _choose_path() -> ManyRowsPath:
    wanted = wanted_path()
    if wanted == "bf16" or (wanted == "auto" and native_bf16()):
        return _bf16_path(f"{PATH_ENV}=bf16" if wanted == "bf16"
                          else "the CPU multiplies bfloat16 natively")
    from vconsole.engine.worker import attention_kernel

    try:
        kernel = attention_kernel.build()
    except Exception as e:      # no compiler: the bf16 path, said to be slow where it is
        return _bf16_path(f"the int8 kernel is unavailable: {e}")
    return ManyRowsPath(kernel.int8_gemm_isa(), kernel.int8_gemm,
                        why=f"{PATH_ENV}=kernel" if wanted == "kernel"
                        else "no native bfloat16 on this CPU")


def predicted_path(flags: set[str] | None = None) -> ManyRowsPath:
    """What `many_rows_path` will choose here, without loading or building the kernel (for
    `vconsole doctor`); ``gemm`` is None. ValueError for a bad `PATH_ENV`, as at the
    engine's start."""
    import shutil

    from vconsole.engine.worker import attention_kernel

    wanted = wanted_path()
    flags = cpu_flags() if flags is None else flags
    if wanted == "bf16" or (wanted != "kernel" and native_bf16(flags)):
        return ManyRowsPath("bf16", slow=not native_bf16(flags),
                            why=f"{PATH_ENV}=bf16" if wanted == "bf16"
                            else "the CPU multiplies bfloat16 natively")
    built = attention_kernel.is_built()
    if not built and shutil.which(attention_kernel._cxx().split()[0]) is None:
        return ManyRowsPath("bf16", slow=True, why="no C++ compiler for the int8 kernel")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    return ManyRowsPath(isa, why="kernel built" if built
                        else "kernel built with the attention kernel on the first start")


def many_rows_path() -> ManyRowsPath:
    """The path steps of more than `SMALL_ROWS` rows take in this process, chosen once (the
    kernel is loaded, or built, on the first call)."""
    global _path
    with _path_lock:
        if _path is None:
            _path = _choose_path()
        return _path


def use_path(path: ManyRowsPath | None) -> None:
    """Set (or, with None, forget) this process's many-rows path: the tests' way to run
    each path on one machine."""
    global _path
    with _path_lock:
        _path = path


def available() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 (N, K), scale (N,) float32)`` with ``weight ~= int8 * scale[:, None]``; the
    error of each entry is at most ``scale[n] / 2``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _bf16_scratch(elements: int, device: torch.device) -> torch.Tensor:
    """One bfloat16 buffer per device, shared by every `Int8Linear` (a step runs one matmul
    at a time), grown to the largest chunk asked for. Made outside inference mode: a buffer
    first made by the engine's step (inside it) could not be written by a later forward
    outside it."""
    buf = _scratch.get(device)
    if buf is None or buf.numel() < elements:
        with torch.inference_mode(False):
            buf = torch.empty(elements, dtype=torch.bfloat16, device=device)
        _scratch[device] = buf
    return buf


class Int8Linear(torch.nn.Module):
    """``y ~= x @ W.T + b`` with ``W`` stored as per-channel int8 (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.register_buffer("scale_bf16", self.scale.to(torch.bfloat16), persistent=False)
        bias = None if bias is None else bias.detach().float().contiguous()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._chunk_rows = max(1, CHUNK_ELEMENTS // self.in_features)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Linear:
        q, scale = quantize_weight(linear.weight)
        return cls(q, scale, linear.bias)

    @classmethod
    def concat(cls, linears: Sequence[Int8Linear]) -> Int8Linear:
        """The linears stacked along the output axis, as one (the same int8 values and scales,
        so the fused output equals the parts' outputs side by side)."""
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.data if lin.bias is not None
                              else torch.zeros(lin.out_features) for lin in linears])
        return cls(torch.cat([lin.qweight for lin in linears]),
                   torch.cat([lin.scale for lin in linears]), bias)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored ``(int8 (N, K), scale (N,))``."""
        return self.qweight, self.scale

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= SMALL_ROWS:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight,
                                          self.scale_bf16).float()
        elif (gemm := many_rows_path().gemm) is not None and x2.device.type == "cpu":
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32,
                            device=x2.device)
            gemm(x2.float().contiguous(), self.qweight, self.scale, y)
        else:
            y = self._many_rows(x2.to(torch.bfloat16))
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        step = min(n, self._chunk_rows)
        scratch = _bf16_scratch(step * k, x.device)
        y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            w = scratch[:(hi - lo) * k].view(hi - lo, k)
            w.copy_(self.qweight[lo:hi])
            y[:, lo:hi] = torch.mm(x, w.t())
        return y.mul_(self.scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights per channel")


def quantize_model(model: torch.nn.Module, method: str) -> int:
    """Replace the float32 CPU ``nn.Linear`` modules of ``model`` (decoder layers and LM head)
    by `Int8Linear`, in place. Returns how many were replaced. Raises ValueError for a method
    other than ``int8`` or a model this cannot serve (not on CPU, not float32, no quantized
    engines in this torch)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {method!r}")
    if not available():
        raise ValueError("quantization int8 needs torch._weight_int8pack_mm (torch >= 2.3)")
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, linear in targets:
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(f"quantization int8 runs on CPU float32 weights; {name} is "
                             f"{linear.weight.dtype} on {linear.weight.device.type}")
    with torch.no_grad():
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, Int8Linear.from_linear(linear))
    path = many_rows_path()
    log.info("int8 weights: %d linears; steps of up to %d rows: _weight_int8pack_mm; more "
             "rows: %s (%s)", len(targets), SMALL_ROWS, path.describe(), path.why)
    if path.slow:
        log.warning("int8 weights: steps of more than %d rows run bfloat16 matmuls that this "
                    "CPU emulates, measured %s; float32 weights (no --quantization) are "
                    "faster under load here. Why the int8 kernel is not used: %s",
                    SMALL_ROWS, EMULATED_BF16_COST, path.why)
    return len(targets)


class SliceOf(torch.nn.Module):
    """Columns ``start:end`` of a fused linear's output: what a q/k/v or gate/up projection
    becomes once `fused_decoder` stacked it into one `Int8Linear` (or a GGUF linear, one
    ``in_features``; transformers' own forward
    then still works, at the cost of the whole fused matmul per part; the fused decoder calls
    the fused linear once)."""

    def __init__(self, fused: torch.nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.end = start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.end]
