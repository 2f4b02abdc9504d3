"""Int8 weights (``--quantization int8``): per-output-channel int8 weights, dynamic int8 activations.

Single-stream decode reads every weight once per token: SmolLM2-135M is 540 MB a token in
float32, and at one row a matmul is a memory-bound matrix-vector product. int8 reads a quarter.

The scheme is vLLM's and torch.ao's "dynamic int8" (W8A8-dynamic): each weight row ``n`` (an
output channel) is stored as ``round(W[n] / s[n])`` in [-127, 127] with ``s[n] = max|W[n]| /
127``; each call quantizes its input per tensor (asymmetric uint8, scale and zero point from the
input's own min/max, so nothing is calibrated) and the kernel multiplies int8 by int8 into int32
and rescales to float32. The kernels are torch's own quantized engines, not ours:

- **fbgemm** (``torch.ops.quantized.linear_dynamic`` with fbgemm-packed weights) for steps of up
  to `SMALL_ROWS` rows: its matrix-vector path costs the least fixed time per call, and a decode
  step of one stream is 30 layers x 4 linears of one row;
- **oneDNN** (the same op with oneDNN-packed weights; AMX int8 where the CPU has it) above: at 64
  rows it is 2-6x fbgemm on the development machine (the LM head's 64 x 576 x 49152: ~2.7 ms
  against ~12-17 ms; float32 ~35-40 ms).

Both packings are kept (int8 twice is still half of float32 once). Why not weight-only int8
(``torch._weight_int8pack_mm``, int8 weights, float activations): on this CPU build its float32
path is ~10x slower than float32 ``F.linear`` and its bfloat16 one slower than fbgemm at one
row and not vectorised for 64 rows. The activation quantization costs accuracy that weight-only
would not: `bench quality --quantization int8` measures it (the goal is perplexity within +1%).

Invariants: only ``torch.nn.Linear`` modules on CPU in float32 are replaced (the decoder layers'
linears and the LM head; the embedding stays float, so a tied LM head becomes an int8 copy);
an `Int8Linear` keeps ``in_features``, ``out_features`` and its float ``bias``; its output is
float32 of the input's shape with the last axis ``out_features``. `Int8Linear.concat` fuses
linears along the output axis exactly (per-channel scales do not change when rows are stacked),
which is how `fused_decoder` builds its qkv and gate/up matmuls.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from vconsole.shared.config import QUANTIZATIONS

SMALL_ROWS = 4        # at most this many rows: fbgemm; more: oneDNN
QMAX = 127


def available() -> bool:
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines and "onednn" in engines


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 (N, K), scale (N,) float32)`` with ``weight ~= int8 * scale[:, None]``; the
    error of each entry is at most ``scale[n] / 2``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          engine: str) -> torch.Tensor:
    """One engine's packed weight (an opaque ``LinearPackedParamsBase``)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated (2.10+)
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros(q.shape[0], dtype=torch.int64), 0)
            return torch.ops.quantized.linear_prepack(qw, bias)
    finally:
        torch.backends.quantized.engine = previous


class Int8Linear(torch.nn.Module):
    """``y ~= x @ W.T + b`` with ``W`` stored as per-channel int8 (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        bias = None if bias is None else bias.detach().float().contiguous()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self._small = _pack(q, scale, bias, "fbgemm")
        self._large = _pack(q, scale, bias, "onednn")

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Linear:
        q, scale = quantize_weight(linear.weight)
        return cls(q, scale, linear.bias)

    @classmethod
    def concat(cls, linears: Sequence[Int8Linear]) -> Int8Linear:
        """The linears stacked along the output axis, as one (the same int8 values and scales,
        so the fused output equals the parts' outputs side by side)."""
        qs, scales = zip(*(lin.int8_weight() for lin in linears), strict=True)
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.data if lin.bias is not None
                              else torch.zeros(lin.out_features) for lin in linears])
        return cls(torch.cat(qs), torch.cat(scales), bias)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored ``(int8 (N, K), scale (N,))``, unpacked from fbgemm's layout."""
        qw, _ = torch.ops.quantized.linear_unpack(self._small)
        return qw.int_repr(), self.scale

    def dequantized_weight(self) -> torch.Tensor:
        q, scale = self.int8_weight()
        return q.float() * scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        packed = self._small if rows <= SMALL_ROWS else self._large
        return torch.ops.quantized.linear_dynamic(x, packed, False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel, dynamic int8 activations")


def quantize_model(model: torch.nn.Module, method: str) -> int:
    """Replace the float32 CPU ``nn.Linear`` modules of ``model`` (decoder layers and LM head)
    by `Int8Linear`, in place. Returns how many were replaced. Raises ValueError for a method
    other than ``int8`` or a model this cannot serve (not on CPU, not float32, no quantized
    engines in this torch)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {method!r}")
    if not available():
        raise ValueError("quantization int8 needs torch's fbgemm and onednn quantized engines "
                         f"(this torch has {', '.join(torch.backends.quantized.supported_engines)})")
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
    return len(targets)


class SliceOf(torch.nn.Module):
    """Columns ``start:end`` of a fused linear's output: what a q/k/v or gate/up projection
    becomes once `fused_decoder` stacked it into one `Int8Linear` (transformers' own forward
    then still works, at the cost of the whole fused matmul per part; the fused decoder calls
    the fused linear once)."""

    def __init__(self, fused: Int8Linear, start: int, end: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.end = start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.end]
