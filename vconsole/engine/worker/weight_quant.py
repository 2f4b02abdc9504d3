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
  is reused by every row): the int8 rows are converted, `CHUNK_ELEMENTS` at a time, into one
  shared bfloat16 scratch (int8 values are exact in bfloat16) and multiplied with bfloat16
  ``torch.mm`` (AVX-512 BF16 / AMX), the float32 scales applied to the product: 1.5-2x float32
  at 64 rows, where ``_weight_int8pack_mm`` is 2x slower than float32.

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

from collections.abc import Sequence

import torch

from vconsole.shared.config import QUANTIZATIONS

SMALL_ROWS = 4                 # at most this many rows: _weight_int8pack_mm
CHUNK_ELEMENTS = 1 << 21       # weights converted to bfloat16 at a time above (4 MiB)
QMAX = 127

_scratch: dict[torch.device, torch.Tensor] = {}


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
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2.shape[0] <= SMALL_ROWS:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scale_bf16).float()
        else:
            y = self._many_rows(x2)
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
