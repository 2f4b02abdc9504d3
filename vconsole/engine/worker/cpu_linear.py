"""CPU linears as oneDNN matmuls over weights packed once at load.

On CPU, ``F.linear`` runs MKL's sgemm over the weight in its plain layout on every call. oneDNN
(``torch.ops.mkldnn``, the path torch.compile's CPU backend takes for linears) reorders each
weight once into its blocked layout and multiplies against that: on the development machine
10–25% less CPU per matmul at the engine's shapes (64 decode rows to 1024 prefill tokens), the
biggest single cost of a step. Results differ from sgemm only by float rounding (~1e-6
relative; summation order), well inside the tests' comparison with transformers.

Invariants: only on CPU, for float32 / bfloat16 weights, when this torch has oneDNN (otherwise
nothing changes); a packed module keeps its name and place in the model (transformers' forward
and the profiler's layer labels are unchanged) and its ``bias``; the plain weight is dropped
(memory stays the same) unless another module shares it (tied embeddings keep theirs).
"""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 64  # rows the packed layout is tuned for: a full decode step


def available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's layout (an opaque mkldnn tensor)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                             _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, oneDNN"


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every packable ``nn.Linear`` of a CPU model by a `PackedLinear`, in place.
    Returns how many were packed (0 when oneDNN is unavailable or the model is not on CPU)."""
    if not available():
        return 0
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype in PACKABLE_DTYPES]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear))
    return len(targets)
