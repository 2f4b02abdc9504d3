"""Quantized KV cache storage: how K and V rows are packed into the pool, and back.

A quantized pool keeps, per layer, K and V as integer data plus one small parameter tensor each,
indexed by the same slot (``block_id * block_size + offset``) as the data:

- ``int8_per_token_head``: symmetric int8, one float32 scale per (slot, KV head):
  ``x ~ scale * q`` with ``q`` in -127..127 and ``scale = max|x| / 127``. Data
  ``(NB, B, KVH, D)`` int8, scales ``(NB, B, KVH, 1)`` float32: ``D + 4`` bytes per token and
  head against ``4 D`` in float32 (3.76x at ``D = 64``).
- ``int4_per_token_head``: asymmetric 4-bit (llama.cpp's ``q4_1`` idea), a float32 scale and
  minimum per (slot, KV head): ``x ~ lo + scale * q`` with ``q`` in 0..15. Two values per byte:
  byte ``j`` of a row holds element ``j`` in its low nibble and element ``j + D/2`` in its high
  one, so 16 bytes unpack into two 16-lane vectors with a mask and a shift. Data
  ``(NB, B, KVH, D/2)`` uint8, parameters ``(NB, B, KVH, 2)`` float32: ``D/2 + 8`` bytes
  (6.4x at ``D = 64``).

Why per token and head, not KIVI's keys per channel: measured on SmolLM2 by `vconsole bench
kv-grouping` (docs/benchmarks.md), per token and head loses less at 8 bits than the noise of the
measurement and an asymmetric 4-bit code per token and head stays inside the goal, while a
per-channel code must wait for a block to fill (or re-quantize it as tokens arrive) before its
scales are known. Rounding is to nearest, so a dequantized value is within half a step
(``scale / 2``) of the original: `bound` says how far that is for a row.

Writes quantize in torch (`quantize_into`); the CPU decode kernel (``csrc``) reads the integer
data and parameters where they lie and dequantizes in registers; the torch fallback and prefill
paths read through `dequantize`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vconsole.shared.config import canonical_kv_cache_dtype


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the pool: its canonical name, the integer data's dtype and width,
    and the float32 parameters kept per (slot, KV head)."""

    name: str
    bits: int                 # 0: not quantized (the model's dtype)
    data_dtype: torch.dtype | None
    params: int               # float32 values per (slot, KV head): 1 scale, or scale + min

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def data_dim(self, head_dim: int) -> int:
        return head_dim if self.bits != 4 else head_dim // 2

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        model_itemsize: int) -> int:
        """K and V of one token in every layer, parameters included."""
        if not self.quantized:
            per_head = head_dim * model_itemsize
        else:
            per_head = self.data_dim(head_dim) + 4 * self.params
        return 2 * num_layers * num_kv_heads * per_head


FORMATS = {
    "auto": KVFormat("auto", 0, None, 0),
    "int8_per_token_head": KVFormat("int8_per_token_head", 8, torch.int8, 1),
    "int4_per_token_head": KVFormat("int4_per_token_head", 4, torch.uint8, 2),
}


def kv_format(name: str) -> KVFormat:
    """The format for a ``kv_cache_dtype`` value (aliases accepted)."""
    return FORMATS[canonical_kv_cache_dtype(name)]


@dataclass
class KVLayer:
    """One layer's K and V in the pool. ``k``/``v`` are ``(NB, B, KVH, Dd)``; for a quantized
    format ``k_params``/``v_params`` are ``(NB, B, KVH, P)`` float32, else None."""

    k: torch.Tensor
    v: torch.Tensor
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:  # ``k, v = layer``: the data, as a pair
        return iter((self.k, self.v))


KVCache = list[KVLayer]


def allocate(fmt: KVFormat, num_layers: int, num_blocks: int, block_size: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> list[KVLayer]:
    """Zeroed pools (zeros dequantize to zeros: padded rows stay finite)."""
    if fmt.bits == 4 and head_dim % 2:
        raise ValueError(f"int4 KV needs an even head_dim, not {head_dim}")
    layers = []
    for _ in range(num_layers):
        if not fmt.quantized:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            layers.append(KVLayer(torch.zeros(shape, dtype=dtype, device=device),
                                  torch.zeros(shape, dtype=dtype, device=device)))
            continue
        assert fmt.data_dtype is not None
        shape = (num_blocks, block_size, num_kv_heads, fmt.data_dim(head_dim))
        pshape = (num_blocks, block_size, num_kv_heads, fmt.params)
        layers.append(KVLayer(
            torch.zeros(shape, dtype=fmt.data_dtype, device=device),
            torch.zeros(shape, dtype=fmt.data_dtype, device=device),
            torch.zeros(pshape, dtype=torch.float32, device=device),
            torch.zeros(pshape, dtype=torch.float32, device=device)))
    return layers


# --- the codes ----------------------------------------------------------------------------------

def quantize(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` (..., D), any float dtype -> (data (..., Dd), params (..., P) float32)."""
    x = x.float()
    if fmt.bits == 8:
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
        return q, scale
    if fmt.bits == 4:
        lo = x.amin(dim=-1, keepdim=True)
        scale = (x.amax(dim=-1, keepdim=True) - lo) / 15.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((x - lo) / safe).clamp_(0, 15).to(torch.uint8)
        half = x.shape[-1] // 2
        packed = q[..., :half] | (q[..., half:] << 4)
        return packed, torch.cat((scale, lo), dim=-1)
    raise ValueError(f"{fmt.name} is not a quantized format")


def dequantize(fmt: KVFormat, data: torch.Tensor, params: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize`: (..., Dd) + (..., P) -> (..., D) in ``dtype``."""
    if fmt.bits == 8:
        return (data.to(torch.float32) * params).to(dtype)
    if fmt.bits == 4:
        q = torch.cat((data & 15, data >> 4), dim=-1).to(torch.float32)
        return (q * params[..., :1] + params[..., 1:]).to(dtype)
    raise ValueError(f"{fmt.name} is not a quantized format")


def bound(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """The largest error `dequantize(quantize(x))` may have per row of ``x``: half a step."""
    x = x.float()
    if fmt.bits == 8:
        return x.abs().amax(dim=-1, keepdim=True) / 127.0 / 2
    return (x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)) / 15.0 / 2


def write(fmt: KVFormat, layer: KVLayer, slots: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """Store the step's new rows ``k``/``v`` (T, KVH, D) at pool slots ``slots`` (T,)."""
    nkv = k.shape[1]
    if not fmt.quantized:
        layer.k.view(-1, nkv, k.shape[2]).index_copy_(0, slots, k)
        layer.v.view(-1, nkv, v.shape[2]).index_copy_(0, slots, v)
        return
    assert layer.k_params is not None and layer.v_params is not None
    for data, params, x in ((layer.k, layer.k_params, k), (layer.v, layer.v_params, v)):
        q, p = quantize(fmt, x)
        data.view(-1, nkv, data.shape[-1]).index_copy_(0, slots, q)
        params.view(-1, nkv, fmt.params).index_copy_(0, slots, p)
