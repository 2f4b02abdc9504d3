"""Int8 weights (``--quantization int8``): int8 weights with per-output-channel scales.

Single-stream decode reads every weight once per token: SmolLM2-135M is 540 MB a token in
float32, and at one row a matmul is a memory-bound matrix-vector product. int8 reads a quarter.

The weights: each row ``n`` (an output channel) is stored as ``q[n] = round(W[n] / s[n])`` in
[-127, 127] with ``s[n] = max|W[n]| / 127`` (the error of a weight is at most ``s[n] / 2``). How
a step multiplies them is one of two paths, chosen once per process by what the CPU has
(`many_rows_path`; ``VCONSOLE_INT8_GEMM`` forces one, see `wanted_path`):

- ``bf16``, where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX): up to
  `SMALL_ROWS` rows torch's weight-only ``torch._weight_int8pack_mm`` (bfloat16 activations and
  scales); more rows convert the int8 rows, `CHUNK_ELEMENTS` at a time, into one shared
  bfloat16 scratch (int8 values are exact in bfloat16) for a bfloat16 ``torch.mm``, the float32
  scales applied to the product. Activations are rounded to bfloat16 (2^-9 relative).
- the **kernel** (``csrc/int8_gemm.cpp``, built with the attention kernel for this CPU)
  everywhere else, for every step: each row of activations is quantized once per call to int8
  in blocks of 32 along K (a scale per block, as llama.cpp's Q8_0 activations), and the
  products are summed exactly in integers: AVX-512 VNNI ``vpdpbusd`` (``avx512-vnni``),
  256-bit VNNI (``avx-vnni``), ``vpmaddubsw`` with the sign trick (``avx2``) or plain C++
  (``generic``), the best this build holds and this CPU runs. The weights are packed once, on
  the first forward, into the kernel's layout (`pack`: panels of 16 channels, K in groups of 4;
  the same bytes, q + 128 for the VNNI paths), which replaces the plain copy. torch emulates
  bfloat16 on an AVX2-only CPU, and the ``bf16`` path there made a loaded engine 3.7x slower
  than float32 (issue #49). Without a compiler the ``bf16`` path is the fallback, and the
  start-up line warns when it is emulated.

The activations' block scale ``a = max|x_block| / 127`` adds at most ``a / 2`` to each input,
so per output ``|error| <= s[n]/2 * |x|_1 + sum_blocks a/2 * |W_q[n, block]|_1`` (tests check
each path against it). Blocks of 32 rather than one scale per row: measured on SmolLM2 (4
windows x 256 tokens of the quality bench's pydoc text and of the held-out python-license
text), one scale per row cost +5.5% perplexity over these int8 weights with float
activations, blocks of 128 +1.2%, blocks of 32 -0.1% and +0.7%.

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
from typing import TYPE_CHECKING

import torch

from vconsole.shared.config import QUANTIZATIONS

if TYPE_CHECKING:
    from vconsole.engine.worker.attention_kernel import Kernel

log = logging.getLogger(__name__)

SMALL_ROWS = 4                 # bf16 path: at most this many rows take _weight_int8pack_mm
CHUNK_ELEMENTS = 1 << 21       # bf16 path: weights converted to bfloat16 at a time (4 MiB)
QMAX = 127

PATH_ENV = "VCONSOLE_INT8_GEMM"   # auto (default), kernel, bf16, or one of KERNEL_PATHS
# The kernel's paths, best first (csrc/int8_gemm.cpp), and the weight bytes each reads: q + 128
# (unsigned) for the VNNI paths and the generic one, q itself for avx2's sign trick.
KERNEL_PATHS = ("avx512-vnni", "avx-vnni", "avx2", "generic")
PANEL, GROUP, BLOCK = 16, 4, 32   # the packed layout: channels per panel, k per group, k per
# activation scale
# What the bf16 path cost where torch emulates bfloat16 (issue #49: a 2-core AVX2 EPYC,
# SmolLM2, 64 concurrent streams over HTTP): said when that path is taken there.
EMULATED_BF16_COST = "3.7x slower than float32 weights at 64 concurrent streams (issue #49)"
# What the kernel's generic path (no AVX2) cost against float32 torch.mm, measured on the
# development machine (its compiler's own vectors, 1 thread, a loaded machine): said when taken.
GENERIC_COST = "0.06-0.15x float32's matmul speed at 64 rows, 0.5-0.7x at one row"

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


def cpu_kernel_paths(flags: set[str] | None = None) -> list[str]:
    """The kernel paths a CPU with ``flags`` runs, best first (what the kernel's own
    ``int8_gemm_paths`` says once built with a compiler that knows them all)."""
    flags = cpu_flags() if flags is None else flags
    out = []
    if {"avx512_vnni", "avx512bw"} <= flags:
        out.append("avx512-vnni")
    if "avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags:
        out.append("avx-vnni")
    if "avx2" in flags:
        out.append("avx2")
    return [*out, "generic"]


def layout_of(path: str) -> str:
    """The bytes a kernel path reads: ``s8`` (q) for avx2, ``u8`` (q + 128) for the others."""
    return "s8" if path == "avx2" else "u8"


@dataclass(frozen=True)
class ManyRowsPath:
    """How an int8 linear multiplies in this process: ``name`` is ``bf16`` or the kernel's path
    (`KERNEL_PATHS`); ``gemm`` the kernel's operator (None for ``bf16``); ``slow`` is set when
    bfloat16 is emulated here. (The kernel takes every step; ``bf16`` takes steps of up to
    `SMALL_ROWS` rows with ``_weight_int8pack_mm``.)"""

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
    kernel, bf16 or a kernel path: the engine's start and `vconsole doctor` refuse the same
    values."""
    wanted = os.environ.get(PATH_ENV, "auto")
    if wanted not in ("auto", "kernel", "bf16", *KERNEL_PATHS):
        raise ValueError(f"{PATH_ENV} must be auto, kernel or bf16 (or a kernel path: "
                         f"{', '.join(KERNEL_PATHS)}); got {wanted!r}")
    return wanted


def kernel_paths(kernel: Kernel) -> list[str]:
    """The paths a built kernel holds and this CPU runs, best first."""
    ops = getattr(torch.ops, kernel.namespace)
    return str(ops.int8_gemm_paths()).split(",")


def _choose_path() -> ManyRowsPath:
    wanted = wanted_path()
    if wanted == "bf16" or (wanted == "auto" and native_bf16()):
        return _bf16_path(f"{PATH_ENV}=bf16" if wanted == "bf16"
                          else "the CPU multiplies bfloat16 natively")
    from vconsole.engine.worker import attention_kernel

    try:
        kernel = attention_kernel.build()
    except Exception as e:      # no compiler: the bf16 path, said to be slow where it is
        if wanted != "auto":    # asked for by name: refused, never silently another path
            raise ValueError(f"{PATH_ENV}={wanted}: the int8 kernel is unavailable: {e}") from e
        return _bf16_path(f"the int8 kernel is unavailable: {e}")
    have = kernel_paths(kernel)
    if wanted in KERNEL_PATHS and wanted not in have:
        raise ValueError(f"{PATH_ENV}={wanted}: this CPU and build run only {', '.join(have)}")
    name = wanted if wanted in KERNEL_PATHS else have[0]
    return ManyRowsPath(name, kernel.int8_gemm,
                        why=f"{PATH_ENV}={wanted}" if wanted != "auto"
                        else "no native bfloat16 on this CPU")


def predicted_path(flags: set[str] | None = None) -> ManyRowsPath:
    """What `many_rows_path` will choose here, without loading or building the kernel (for
    `vconsole doctor`); ``gemm`` is None. ValueError for a bad `PATH_ENV`, as at the
    engine's start."""
    import shutil

    from vconsole.engine.worker import attention_kernel

    wanted = wanted_path()
    flags = cpu_flags() if flags is None else flags
    if wanted == "bf16" or (wanted == "auto" and native_bf16(flags)):
        return ManyRowsPath("bf16", slow=not native_bf16(flags),
                            why=f"{PATH_ENV}=bf16" if wanted == "bf16"
                            else "the CPU multiplies bfloat16 natively")
    built = attention_kernel.is_built()
    if not built and shutil.which(attention_kernel._cxx().split()[0]) is None:
        return ManyRowsPath("bf16", slow=True, why="no C++ compiler for the int8 kernel")
    have = cpu_kernel_paths(flags)
    if wanted in KERNEL_PATHS and wanted not in have:
        raise ValueError(f"{PATH_ENV}={wanted}: this CPU runs only {', '.join(have)}")
    name = wanted if wanted in KERNEL_PATHS else have[0]
    return ManyRowsPath(name, why="kernel built" if built
                        else "kernel built with the attention kernel on the first start")


def many_rows_path() -> ManyRowsPath:
    """The path int8 linears take in this process, chosen once (the kernel is loaded, or
    built, on the first call)."""
    global _path
    with _path_lock:
        if _path is None:
            _path = _choose_path()
        return _path


def use_path(path: ManyRowsPath | None) -> None:
    """Set (or, with None, forget) this process's path: the tests' way to run each path on
    one machine."""
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


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def pack(q: torch.Tensor, layout: str) -> torch.Tensor:
    """``q`` (N, K) int8 in the kernel's layout, ``(N/16, K/4, 16, 4)`` (N padded to 16 and K
    to 32 with zeros): ``packed[p, g, c, t] = q[16 p + c, 4 g + t]``, plus 128 (as unsigned
    bytes) for the ``u8`` layout (`layout_of`)."""
    n, k = q.shape
    padded = torch.zeros(_ceil(n, PANEL), _ceil(k, BLOCK), dtype=torch.int8)
    padded[:n, :k] = q
    out = padded.view(-1, PANEL, padded.shape[1] // GROUP, GROUP).permute(0, 2, 1, 3)
    out = out.contiguous()
    if layout == "u8":
        out = out.view(torch.uint8).bitwise_xor_(0x80).view(torch.int8)
    return out


def unpack(packed: torch.Tensor, n: int, k: int, layout: str) -> torch.Tensor:
    """The plain ``(N, K)`` int8 weights of `pack`'s output."""
    if layout == "u8":
        packed = packed.view(torch.uint8).bitwise_xor(0x80).view(torch.int8)
    rows = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * PANEL, -1)
    return rows[:n, :k].contiguous()


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
    """``y ~= x @ W.T + b`` with ``W`` stored as per-channel int8 (see the module docstring).
    ``qweight`` holds the int8 weights once: plain ``(N, K)``, or packed for the kernel
    (``_layout`` says which; the first forward on the kernel path packs them)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous(), persistent=False)
        self._layout = "plain"
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
        return cls(torch.cat([lin.int8_weight()[0] for lin in linears]),
                   torch.cat([lin.scale for lin in linears]), bias)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored ``(int8 (N, K), scale (N,))`` (unpacked when packed)."""
        if self._layout == "plain":
            return self.qweight, self.scale
        return unpack(self.qweight, self.out_features, self.in_features, self._layout), self.scale

    def dequantized_weight(self) -> torch.Tensor:
        return self.int8_weight()[0].float() * self.scale[:, None]

    def _weight_in(self, layout: str) -> torch.Tensor:
        """``qweight`` in ``layout`` (``plain``, ``u8`` or ``s8``), converted in place (one
        copy kept) when it is in another. Made outside inference mode, as `_bf16_scratch`."""
        if self._layout != layout:
            with torch.inference_mode(False), torch.no_grad():
                plain = self.int8_weight()[0]
                self.qweight = plain if layout == "plain" else pack(plain, layout)
            self._layout = layout
        return self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        path = many_rows_path()
        if path.gemm is not None and x2.device.type == "cpu":
            w = self._weight_in(layout_of(path.name))
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32,
                            device=x2.device)
            path.gemm(x2.float().contiguous(), w, self.scale, y, path.name)
        elif x2.shape[0] <= SMALL_ROWS:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self._weight_in("plain"),
                                          self.scale_bf16).float()
        else:
            y = self._many_rows(x2.to(torch.bfloat16))
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        qweight = self._weight_in("plain")
        step = min(n, self._chunk_rows)
        scratch = _bf16_scratch(step * k, x.device)
        y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            w = scratch[:(hi - lo) * k].view(hi - lo, k)
            w.copy_(qweight[lo:hi])
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
    if method != "int8":             # int4 and gguf are GGUF blocks (int4_weights, gguf_linear)
        raise ValueError(f"this quantizes into int8 only; got {method!r} (the engine takes "
                         f"{', '.join(QUANTIZATIONS)})")
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
    if path.gemm is not None:
        log.info("int8 weights: %d linears; every step: %s (%s), activations quantized to "
                 "int8 in blocks of %d", len(targets), path.describe(), path.why, BLOCK)
    else:
        log.info("int8 weights: %d linears; steps of up to %d rows: _weight_int8pack_mm; "
                 "more rows: %s (%s)", len(targets), SMALL_ROWS, path.describe(), path.why)
    if path.name == "generic":
        log.warning("int8 weights: this CPU has no integer dot-product instructions the int8 "
                    "kernel uses (AVX2, VNNI); its generic path measured %s; float32 weights "
                    "(no --quantization) are likely faster here", GENERIC_COST)
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
