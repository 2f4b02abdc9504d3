"""The error an int8 linear (`weight_quant.Int8Linear`) may make, from its scheme: the tests of
``test_int8_gemm.py`` and ``test_weight_quant.py`` hold every path to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vconsole.engine.worker.weight_quant import BLOCK, QMAX


def block_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over each block of `BLOCK` along the last axis (zero-padded), (M, K/BLOCK)."""
    k = x.shape[-1]
    return F.pad(x.float(), (0, -k % BLOCK)).view(x.shape[0], -1, BLOCK).abs().amax(-1)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activation scales, ``max |x| / QMAX`` per block (M, K / BLOCK)."""
    return block_max(x) / QMAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x (M, K), in the same float32 steps: ``(xq (M, K) int8 as
    float64, a (M, K / BLOCK))``, ``xq = round(x * (127 / amax))`` per block."""
    amax = block_max(x)
    a = amax / QMAX
    inv = torch.where(amax > 0, torch.tensor(float(QMAX)) / amax, torch.zeros(()))
    k = x.shape[-1]
    per_k = inv.repeat_interleave(BLOCK, dim=1)[:, :k]
    xq = torch.round(x.float() * per_k).clamp(-QMAX, QMAX)
    return xq.double(), a


def activation_error(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """How far quantizing the activations may move ``x @ (q s)^T``: ``a[m, b] / 2`` on each
    input of block ``b``, so ``sum_b a[m, b] / 2 * s[n] * sum_{k in b} |q[n, k]|`` (M, N)."""
    k = q.shape[1]
    qabs = F.pad(q.double().abs(), (0, -k % BLOCK)).view(q.shape[0], -1, BLOCK).sum(-1)
    return (block_scales(x).double() / 2) @ (qabs * s.double()[:, None]).t()


def int8_linear_bound(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, want: torch.Tensor,
                      path: str) -> torch.Tensor:
    """The bound on ``|int8 linear(x) - float linear(x)|`` per output, on ``path`` (``bf16``
    or a kernel path): half a weight step on every product, ``s[n] / 2 * |x|_1``; then on the
    kernel paths the activations' block rounding (`activation_error`) and float32 rounding
    (1e-5 of the magnitudes), on ``bf16`` bfloat16's rounding of the input, the scale and
    the output (each within 2^-9 relative; 2^-8 allowed)."""
    stored = q.double() * s.double()[:, None]
    xd = x.double()
    weight = s.double()[None, :] / 2 * xd.abs().sum(1, keepdim=True)
    magnitudes = xd.abs() @ stored.abs().t() + want.double().abs()
    if path == "bf16":
        return weight + 2 ** -8 * magnitudes + 1e-5
    return weight + activation_error(x, q, s) + 1e-5 * magnitudes + 1e-6
