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
- ``int4_kivi`` (the ``int4`` alias): values as ``int4_per_token_head`` but with their scale
  and minimum in float16; keys in the same 4-bit layout but rounded per channel over each block
  (KIVI), with a float16 scale and minimum per (block, KV head, channel). A block still filling
  keeps its keys staged until its last slot is written (`kv_open_blocks`), as int8 with a
  float32 scale per row (`int8_per_token_head`'s rounding), then they are rounded per channel.
  ``D/2 + 4`` bytes per token for V, ``D/2 + 4D/B`` for K (6.1x at ``D = 64``, ``B = 16``).
- ``int8_kivi``: values as ``int8_per_token_head`` but with a float16 scale; keys int8 rounded
  per channel over each block, symmetric, a float16 scale per (block, KV head, channel) (no
  minimum), staged in float16 while their block fills. ``D + 2`` bytes per token for V,
  ``D + 2D/B`` for K (3.71x at ``D = 64``, ``B = 16``).

The per-channel formats' staging is a block of the pool: their K and V data lie side by side
per slot, so one block's data is ``B * KVH * 2 Dd`` bytes, exactly an open block's keys in
float16 (`int8_kivi`) or in int8 (`int4_kivi`, whose row scales take that block's values'
float16 parameters). The KV manager lends each running request one block for it
(`KVCacheManager.lend_staging_blocks`): a budget holds its blocks, and what is open costs a
block per running request while it runs, not a reserve per seat (`staging_view`).

The staging's form follows what the block's keys become. At 4 bits, keys staged as int8 per row
and then rounded per channel lose what keys rounded per channel straight from float do
(`vconsole bench kv-grouping`: a per-token logprob change of 0.125 against 0.126 on pydoc, 0.153
against 0.153 on the held-out python-license): the 4-bit step is 20x int8's. At 8 bits a second
rounding would add int8's per-row error to the per-channel one, which is what `int8_kivi` is
there to remove: its staging stays float16.

Why these groupings, measured on SmolLM2 by `vconsole bench kv-grouping` (docs/benchmarks.md):
at 8 bits the keys carry most of the error (values alone a quarter of it): their few outlier
channels set each token's scale, and keys per channel over a block halve the per-token change
of the logprobs (0.028 -> 0.014 nats on average), hence ``int8_kivi``; ``int8_per_token_head``
stays as the one without staging. At 4 bits per token and head loses +16% (a few outlier
key channels set every token's range), groups of 32 +6%, a Hadamard rotation of each head first
+6.7%, and keys per channel over a 16-token block +1.2%: the 4-bit format worth having is
KIVI's, at the price of staging open blocks. ``int4_per_token_head`` stays for vLLM's name and
as the densest. Rounding is to nearest, so a dequantized value is within half a step
(``scale / 2``) of the original: `bound` says how far that is for a row.

Writes quantize in torch (`quantize_into`); the CPU decode kernel (``csrc``) reads the integer
data and parameters where they lie and dequantizes in registers; the torch fallback and prefill
paths read through `dequantize`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vconsole.engine.worker.kv_open_blocks import OpenPlan
from vconsole.shared.config import canonical_kv_cache_dtype


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the pool: its canonical name, the integer data's dtype and width,
    and the float32 parameters kept per (slot, KV head). ``key_per_channel``: keys are rounded
    per channel over a block (`int4_kivi`, see `vconsole.engine.worker.kv_open_blocks`)."""

    name: str
    bits: int                 # 0: not quantized (the model's dtype)
    data_dtype: torch.dtype | None
    params: int               # values per (slot, KV head): 1 scale, or scale + min
    key_per_channel: bool = False
    stage_int8: bool = False  # a per-channel format's open keys as int8 per row (else float16)

    @property
    def value_params_dtype(self) -> torch.dtype:
        """The values' parameters: float16 in a per-channel format, else float32."""
        return torch.float16 if self.key_per_channel else torch.float32

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def data_dim(self, head_dim: int) -> int:
        return head_dim if self.bits != 4 else head_dim // 2

    @property
    def channel_rows(self) -> int:
        """float16 rows of a per-channel format's key parameters per (block, KV head): scale
        and minimum at 4 bits, the scale alone at 8 (symmetric)."""
        return 2 if self.bits == 4 else 1

    def bytes_per_block(self, block_size: int, num_layers: int, num_kv_heads: int,
                        head_dim: int, model_itemsize: int) -> int:
        """K and V of one block in every layer, parameters included."""
        if not self.quantized:
            per_head = 2 * block_size * head_dim * model_itemsize
        elif self.key_per_channel:   # V per token (float16 parameters); K's per channel
            per_head = (2 * block_size * (self.data_dim(head_dim)) + block_size * 2 * self.params
                        + 2 * self.channel_rows * head_dim)
        else:
            per_head = 2 * block_size * (self.data_dim(head_dim) + 4 * self.params)
        return num_layers * num_kv_heads * per_head

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        model_itemsize: int, block_size: int = 16) -> int:
        """K and V of one token in every layer, parameters included (a per-channel format's
        per-block parameters shared out over the block, rounded up)."""
        per_block = self.bytes_per_block(block_size, num_layers, num_kv_heads, head_dim,
                                         model_itemsize)
        return -(-per_block // block_size)


FORMATS = {
    "auto": KVFormat("auto", 0, None, 0),
    "int8_per_token_head": KVFormat("int8_per_token_head", 8, torch.int8, 1),
    "int4_per_token_head": KVFormat("int4_per_token_head", 4, torch.uint8, 2),
    "int4_kivi": KVFormat("int4_kivi", 4, torch.uint8, 2, key_per_channel=True,
                          stage_int8=True),
    "int8_kivi": KVFormat("int8_kivi", 8, torch.int8, 1, key_per_channel=True),
}


def kv_format(name: str) -> KVFormat:
    """The format for a ``kv_cache_dtype`` value (aliases accepted)."""
    return FORMATS[canonical_kv_cache_dtype(name)]


@dataclass
class KVLayer:
    """One layer's K and V in the pool. ``k``/``v`` are ``(NB, B, KVH, Dd)``; for a quantized
    format ``k_params``/``v_params`` are ``(NB, B, KVH, P)`` float32, else None. A per-channel
    format has ``k_params`` ``(NB, KVH, R, D)`` float16 (each channel's scale and, for
    `int4_kivi`, minimum over the block: ``R = KVFormat.channel_rows``), ``v_params`` in
    float16, and ``k_stage`` ``(NB, B, KVH, D)``, the open blocks' keys (`kv_open_blocks`) in
    the pool's own bytes (`staging_view`): float16, or int8 with ``k_stage_scale``
    ``(NB, B, KVH, 1)`` float32 (`int4_kivi`; else ``k_stage_scale`` is empty); their ``k``
    and ``v`` are then the two halves of one tensor. ``k, v = layer`` unpacks the data only."""

    k: torch.Tensor
    v: torch.Tensor
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None
    k_stage: torch.Tensor | None = None
    k_stage_scale: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:  # ``k, v = layer``: the data, as a pair
        return iter((self.k, self.v))


KVCache = list[KVLayer]


def allocate(fmt: KVFormat, num_layers: int, num_blocks: int, block_size: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> list[KVLayer]:
    """Zeroed pools (zeros dequantize to zeros: padded rows stay finite). A per-channel format
    keeps each slot's K and V data side by side in one tensor, so that any block of the pool
    can hold an open block's staged keys (`staging_view`): ``k``/``v`` are its two halves."""
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
        if fmt.key_per_channel:
            kv = torch.zeros((num_blocks, block_size, 2, num_kv_heads, fmt.data_dim(head_dim)),
                             dtype=fmt.data_dtype, device=device)
            v_params = torch.zeros(pshape, dtype=fmt.value_params_dtype, device=device)
            stage, stage_scale = staging_view(fmt, kv, v_params)
            layers.append(KVLayer(
                kv[:, :, 0], kv[:, :, 1],
                torch.zeros((num_blocks, num_kv_heads, fmt.channel_rows, head_dim),
                            dtype=torch.float16, device=device),
                v_params, stage, stage_scale))
            continue
        layers.append(KVLayer(
            torch.zeros(shape, dtype=fmt.data_dtype, device=device),
            torch.zeros(shape, dtype=fmt.data_dtype, device=device),
            torch.zeros(pshape, dtype=torch.float32, device=device),
            torch.zeros(pshape, dtype=torch.float32, device=device)))
    return layers


def staging_view(fmt: KVFormat, kv: torch.Tensor,
                 v_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-channel pool's blocks seen as staging entries, entry ``e`` being block ``e``'s own
    bytes (the KV manager lends a running request one block for it, `KVCacheManager`): a
    block's K and V data, ``B * KVH * 2 Dd`` bytes, hold ``(B, KVH, D)`` float16 keys
    (`int8_kivi`) or int8 ones (`int4_kivi`), whose float32 scale per row takes the block's
    values' parameters, ``(B, KVH, 2)`` float16. Returns ``(k_stage, k_stage_scale)`` as
    `KVLayer` keeps them (the scale empty for float16 staging)."""
    nb, bs, _, nkv, dd = kv.shape
    flat = kv.view(nb, -1)
    if fmt.stage_int8:
        return (flat.view(torch.int8).view(nb, bs, nkv, 2 * dd),
                v_params.view(torch.float32).view(nb, bs, nkv, 1))
    return (flat.view(torch.float16).view(nb, bs, nkv, dd),
            torch.zeros((0,), dtype=torch.float32, device=kv.device))


def staging_bytes(fmt: KVFormat, open_blocks: int, block_size: int, num_layers: int,
                  num_kv_heads: int, head_dim: int) -> int:
    """The pool bytes that ``open_blocks`` open blocks' staged keys take (0 for a format
    without): one block of the pool each."""
    if not fmt.key_per_channel:
        return 0
    return open_blocks * fmt.bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, 1)


# --- the codes ----------------------------------------------------------------------------------

def quantize(fmt: KVFormat, x: torch.Tensor,
             params_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` (..., D), any float dtype -> (data (..., Dd), params (..., P) in
    ``params_dtype``; the rounding uses the parameters as stored)."""
    x = x.float()

    def stored(t: torch.Tensor) -> torch.Tensor:
        return t.to(params_dtype).float()

    if fmt.bits == 8:
        scale = stored(x.abs().amax(dim=-1, keepdim=True) / 127.0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
        return q, scale.to(params_dtype)
    if fmt.bits == 4:
        lo = stored(x.amin(dim=-1, keepdim=True))
        scale = stored((x.amax(dim=-1, keepdim=True) - lo) / 15.0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((x - lo) / safe).clamp_(0, 15).to(torch.uint8)
        return _pack4(q), torch.cat((scale, lo), dim=-1).to(params_dtype)
    raise ValueError(f"{fmt.name} is not a quantized format")


def dequantize(fmt: KVFormat, data: torch.Tensor, params: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize`: (..., Dd) + (..., P) -> (..., D) in ``dtype``."""
    if params.dtype == torch.float16:
        # A per-channel pool's values: a block lent for staging keeps float32 row scales in
        # these bytes (`staging_view`), NaN or inf as float16, on rows no query attends (the
        # torch path's padding): read as zeros, so that a masked row stays a zero weight.
        params = torch.nan_to_num(params.float(), nan=0.0, posinf=0.0, neginf=0.0)
    params = params.float()
    if fmt.bits == 8:
        return (data.to(torch.float32) * params).to(dtype)
    if fmt.bits == 4:
        return (_unpack4(data) * params[..., :1] + params[..., 1:]).to(dtype)
    raise ValueError(f"{fmt.name} is not a quantized format")


def bound(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """The largest error `dequantize(quantize(x))` may have per row of ``x``: half a step."""
    x = x.float()
    if fmt.bits == 8:
        return x.abs().amax(dim=-1, keepdim=True) / 127.0 / 2
    return (x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)) / 15.0 / 2


def _pack4(q: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def _unpack4(data: torch.Tensor) -> torch.Tensor:
    return torch.cat((data & 15, data >> 4), dim=-1).to(torch.float32)


def dequantize_sealed_keys(data: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Per-channel keys back to float32: data (..., B, KVH, D/2) uint8 with params
    (..., KVH, 2, D) float16 (`int4_kivi`), or data (..., B, KVH, D) int8 with params
    (..., KVH, 1, D) (`int8_kivi`) -> (..., B, KVH, D)."""
    p = params.float()
    if data.dtype == torch.int8:
        return data.float() * p[..., None, :, 0, :]
    return _unpack4(data) * p[..., None, :, 0, :] + p[..., None, :, 1, :]


def seal_keys(layer: KVLayer, blocks: torch.Tensor, work: torch.Tensor,
              fill: torch.Tensor) -> None:
    """Round ``work`` (S, B, KVH, D), the whole keys of blocks ``blocks``, per channel over each
    block's first ``fill`` rows, into the pool."""
    assert layer.k_params is not None
    valid = (torch.arange(work.shape[1], device=work.device)[None, :] < fill[:, None])
    valid = valid[:, :, None, None]
    if layer.k.dtype == torch.int8:   # int8_kivi: symmetric, the scale alone
        top = torch.where(valid, work.abs(), 0.0).amax(dim=1)           # (S, KVH, D)
        scale = (top / 127.0).half().float()                             # as stored
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q8 = torch.round(work / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        layer.k.index_copy_(0, blocks, q8)
        layer.k_params.index_copy_(0, blocks, scale[:, :, None].half())
        return
    lo = torch.where(valid, work, torch.inf).amin(dim=1)              # (S, KVH, D)
    hi = torch.where(valid, work, -torch.inf).amax(dim=1)
    scale = ((hi - lo) / 15.0).half().float()                           # as stored
    lo = lo.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((work - lo[:, None]) / safe[:, None]).clamp_(0, 15).to(torch.uint8)
    layer.k.index_copy_(0, blocks, _pack4(q))
    layer.k_params.index_copy_(0, blocks, torch.stack((scale, lo), dim=2).half())


_STAGE_I8 = KVFormat("int8_per_token_head", 8, torch.int8, 1)   # int4_kivi's staged rows


def staged_rows(layer: KVLayer, rows: torch.Tensor) -> torch.Tensor:
    """Staged key rows ``rows`` (``entry * B + offset``) as float32 (n, KVH, D)."""
    assert layer.k_stage is not None and layer.k_stage_scale is not None
    nkv, hd = layer.k_stage.shape[2], layer.k_stage.shape[3]
    data = layer.k_stage.view(-1, nkv, hd).index_select(0, rows)
    if layer.k_stage.dtype != torch.int8:
        return data.float()
    return data.float() * layer.k_stage_scale.view(-1, nkv, 1).index_select(0, rows)


def stage_rows(layer: KVLayer, rows: torch.Tensor, x: torch.Tensor, kernel: Any = None) -> None:
    """Put key rows ``x`` (n, KVH, D) at staging rows ``rows``: float16, or int8 per row."""
    assert layer.k_stage is not None and layer.k_stage_scale is not None
    if layer.k_stage.dtype != torch.int8:
        layer.k_stage.view(-1, x.shape[1], x.shape[2]).index_copy_(0, rows, x.half())
        return
    _store_rows(_STAGE_I8, layer.k_stage, layer.k_stage_scale, rows, x.float(), kernel)


def write_per_channel(fmt: KVFormat, layer: KVLayer, plan: OpenPlan, slots: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, kernel: Any = None) -> None:
    """`write` for a per-channel format: values rounded per token into their slots; keys routed by the
    step's `OpenPlan` into staging (blocks still filling) or rounded per channel
    (blocks sealed now). The reads of staging come first: an entry freed and taken again in one
    step."""
    assert layer.k_params is not None and layer.v_params is not None
    assert layer.k_stage is not None and layer.k_stage_scale is not None
    nkv, hd = k.shape[1], k.shape[2]
    bs = layer.k.shape[1]
    _store_rows(fmt, layer.v, layer.v_params, slots, v, kernel)
    num_seal = plan.seal_blocks.shape[0]
    work = None
    if num_seal:
        work = k.new_zeros((num_seal * bs, nkv, hd), dtype=torch.float32)
        dst, src = plan.work_from_stage
        if dst.numel():
            work.index_copy_(0, dst, staged_rows(layer, src))
        idx, blocks = plan.work_from_sealed
        if idx.numel():
            rows = dequantize_sealed_keys(layer.k.index_select(0, blocks),
                                          layer.k_params.index_select(0, blocks))
            work.view(num_seal, bs, nkv, hd).index_copy_(0, idx, rows)
    if plan.fresh_entries.numel():
        # A lent block's bytes held other keys or values: an entry a block starts in reads as
        # zeros past its filled rows (the torch path reads whole blocks, padding masked),
        # never as those bits taken for float16 rows or float32 scales (NaN or inf).
        layer.k_stage.index_fill_(0, plan.fresh_entries, 0)
        if layer.k_stage_scale.numel():
            layer.k_stage_scale.index_fill_(0, plan.fresh_entries, 0)
    entries, blocks = plan.reload
    if entries.numel():
        rows = dequantize_sealed_keys(layer.k.index_select(0, blocks),
                                      layer.k_params.index_select(0, blocks))
        at = (entries[:, None] * bs + torch.arange(bs, device=entries.device)).reshape(-1)
        stage_rows(layer, at, rows.reshape(-1, nkv, hd), kernel)
    dst, src = plan.stage_from_batch
    if dst.numel():
        stage_rows(layer, dst, k.index_select(0, src), kernel)
    if work is not None:
        dst, src = plan.work_from_batch
        if dst.numel():
            work.index_copy_(0, dst, k.index_select(0, src).float())
        seal_keys(layer, plan.seal_blocks, work.view(num_seal, bs, nkv, hd), plan.seal_fill)


def read_keys(layer: KVLayer, blocks: torch.Tensor, entry_of: torch.Tensor) -> torch.Tensor:
    """Whole blocks of a per-channel format's keys as float32 (n, B, KVH, D): sealed ones
    dequantized, open ones from staging (the torch path; the CPU kernel reads them in place)."""
    assert layer.k_params is not None and layer.k_stage is not None
    keys = dequantize_sealed_keys(layer.k.index_select(0, blocks),
                                  layer.k_params.index_select(0, blocks))
    entries = entry_of.index_select(0, blocks)
    bs = layer.k_stage.shape[1]
    at = (entries.clamp(min=0)[:, None] * bs + torch.arange(bs, device=blocks.device))
    staged = staged_rows(layer, at.reshape(-1)).view(keys.shape)
    # No host sync (a nonzero() would be one per layer on CUDA): both, then pick.
    return torch.where((entries >= 0)[:, None, None, None], staged, keys)


def _store_rows(fmt: KVFormat, data: torch.Tensor, params: torch.Tensor, slots: torch.Tensor,
                x: torch.Tensor, kernel: Any) -> None:
    """Round rows ``x`` (T, KVH, D) per token and head into ``data``/``params`` (float32 or
    float16) at ``slots``: in one call of the CPU kernel when it is there (float32 rows), else in
    torch."""
    if kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        kernel.quantize_store(x.contiguous(), slots, data, params, fmt.bits)
        return
    nkv = x.shape[1]
    q, p = quantize(fmt, x, params.dtype)
    data.view(-1, nkv, data.shape[-1]).index_copy_(0, slots, q)
    params.view(-1, nkv, fmt.params).index_copy_(0, slots, p)


def write(fmt: KVFormat, layer: KVLayer, slots: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, kernel: Any = None) -> None:
    """Store the step's new rows ``k``/``v`` (T, KVH, D) at pool slots ``slots`` (T,)
    (``kernel``: the CPU attention module, whose ``quantize_store`` does the rounding)."""
    nkv = k.shape[1]
    if not fmt.quantized:
        layer.k.view(-1, nkv, k.shape[2]).index_copy_(0, slots, k)
        layer.v.view(-1, nkv, v.shape[2]).index_copy_(0, slots, v)
        return
    assert layer.k_params is not None and layer.v_params is not None
    _store_rows(fmt, layer.k, layer.k_params, slots, k, kernel)
    _store_rows(fmt, layer.v, layer.v_params, slots, v, kernel)
