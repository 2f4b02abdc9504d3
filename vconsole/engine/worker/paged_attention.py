"""Attention over the engine's paged KV block pool, plugged into transformers' attention interface.

The model runs one packed sequence per step: ``input_ids`` is (1, T) with every scheduled token
of every request back to back, and ``position_ids`` carries each token's true position. HF's
attention modules compute q/k/v and RoPE as usual and then call the function registered here
under ``ATTN_IMPLEMENTATION`` with ``module.layer_idx`` and our per-step `PagedAttentionMetadata`
(passed down as the ``paged_metadata`` keyword, which transformers forwards untouched). No HF
cache object exists anywhere: the pool *is* the cache.

The function (per layer):
1. writes the step's new K/V into ``pool[slot_mapping]`` (slot = block_id * block_size + offset);
2. decode rows (sequences with one new token, placed first in the packed batch) attend over
   their context: on the CPU in float32 through the compiled kernel of `attention_kernel`,
   which reads K/V in place through the block table; otherwise in one padded SDPA call per
   group over their blocks gathered from the pool, with a length mask;
3. each prefill chunk attends causally over its whole context read back from the pool (or, for
   a chunk that starts at position 0, directly over its fresh K/V, which are bit-identical);
   a speculative draft row (a chunk of the request's last token and its draft), and a chunk
   continuing a request over a quantized pool, runs on the CPU kernel instead, each token a row over the chunk's
   block table seeing the keys up to its own position.

No attention mask is built by transformers: ``vconsole_paged`` is deliberately *not* registered
in ``AttentionMaskInterface``, which makes ``create_causal_mask`` return ``None`` at once (the
path transformers keeps for vLLM/TGI-style backends) and skips its packed-sequence detection,
a device sync per forward. Masking is done here, from positions.

Pool layout per layer: a `kv_quant.KVLayer`, K and V each ``(num_blocks, block_size,
num_kv_heads, head_dim)`` in the model's dtype, or for a quantized ``kv_cache_dtype`` their
integer data plus a scale (and minimum) per slot and KV head, quantized as they are written and
dequantized as they are read (in registers by the CPU kernel; by ``dequantize`` on the torch
path, over the gathered blocks only). All zero-initialised. Zeros matter: padded decode rows read stale-but-finite slots that the mask
drops; uninitialised memory could hold NaN, and ``0 * NaN`` would leak through the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vconsole.engine.worker import kv_quant
from vconsole.engine.worker.kv_open_blocks import OpenPlan
from vconsole.engine.worker.kv_quant import FORMATS, KVCache, KVFormat

ATTN_IMPLEMENTATION = "vconsole_paged"
METADATA_KWARG = "paged_metadata"


class Workspace:
    """Scratch memory for the decode gather that lives across steps and grows on demand.

    Multi-MB buffers allocated fresh every step are served by new pages from the OS on CPU
    (page faults cost more than the copy itself); reusing one buffer avoids that. Views handed
    out by `buffers` are valid until the next call.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def buffers(self, shape: tuple[int, ...], like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        numel = 1
        for n in shape:
            numel *= n
        if (self._k is None or self._k.numel() < numel or self._k.dtype != like.dtype
                or self._k.device != like.device):
            self._k = like.new_empty(numel)
            self._v = like.new_empty(numel)
        assert self._v is not None
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


@dataclass
class PrefillChunk:
    """One multi-token chunk of a request inside the packed batch.

    Tokens ``offset .. offset + num_tokens`` of the batch are positions ``start_pos ..`` of the
    request. ``context_slots`` (length ``start_pos + num_tokens``) lists the pool slots of the
    whole context, in position order; ``None`` when ``start_pos == 0`` (fresh K/V are used).
    """

    offset: int
    num_tokens: int
    start_pos: int
    context_slots: torch.Tensor | None
    # The blocks holding the context, in order (None when ``start_pos == 0``): the CPU kernel
    # reads a quantized context through it, one kernel row per query token.
    block_table: torch.Tensor | None = None
    # A speculative draft row (the request's last token and its draft, `spec_verify`): on the
    # CPU kernel each token is a row of its own over the block table, as the native decode
    # step runs it (`native_decode`), whatever the pool's format.
    draft: bool = False
    _query_lens: torch.Tensor | None = None

    def query_lens(self) -> torch.Tensor:
        """(num_tokens,) int64: the context each query token sees, ``start_pos + i + 1``."""
        if self._query_lens is None:
            dev = self.context_slots.device if self.context_slots is not None else None
            self._query_lens = torch.arange(self.start_pos + 1,
                                            self.start_pos + self.num_tokens + 1, device=dev)
        return self._query_lens


@dataclass
class DecodeGroup:
    """Decode rows ``lo .. hi`` of the packed batch, gathered and attended together.

    The runner sorts decode rows by context length, so each group pads its gather only to its
    own longest context instead of the step's: short and long requests do not pay for each
    other's padding.
    """

    lo: int
    hi: int
    block_tables: torch.Tensor  # ((hi - lo) * max_blocks,) int64, row-major, padded with 0
    max_blocks: int
    context_lens: torch.Tensor  # (hi - lo,) int64
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, block_size: int, sliding_window: int | None, dtype: torch.dtype
             ) -> torch.Tensor:
        """Additive mask (rows, 1, 1, max_blocks * B): 0 where key position < context length
        (and inside the sliding window), -inf elsewhere. Built once per step per window."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            lens = self.context_lens
            kpos = torch.arange(self.max_blocks * block_size, device=lens.device)
            keep = kpos[None, :] < lens[:, None]
            if sliding_window is not None:
                keep &= kpos[None, :] >= (lens - sliding_window)[:, None]
            mask = torch.zeros(keep.shape, dtype=dtype, device=lens.device)
            mask.masked_fill_(~keep, float("-inf"))
            mask = mask[:, None, None, :]
            self._masks[sliding_window] = mask
        return mask


@dataclass
class PagedAttentionMetadata:
    """Everything the attention function needs for one step; built once, shared by all layers.

    Invariant: the packed batch is ``num_decodes`` single-token rows (covered, in order, by
    ``decode_groups``) followed by the prefill chunks in order, so
    ``sum(c.num_tokens for c in prefills) + num_decodes == T``.
    """

    kv_caches: KVCache
    block_size: int
    slot_mapping: torch.Tensor                       # (T,) int64
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: Workspace | None = None
    # The compiled CPU decode kernel (`attention_kernel`), or None: gather + SDPA in torch.
    decode_kernel: Any = None
    kv_format: KVFormat = FORMATS["auto"]
    # A per-channel format's routing of this step's new keys (`kv_open_blocks`).
    open_plan: OpenPlan | None = None
    # A step of decode rows and draft rows only, small enough for the native decode step: all
    # its T rows as decode rows (lo 0, hi T), a draft row's tokens one row each with the
    # request's block table and context ``position + 1`` (`native_decode`); None otherwise.
    decode_view: DecodeGroup | None = None
    _prefill_masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def gather_buffers(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (rows, B, KVH, hd) buffers for a decode gather, from the step-spanning workspace
        (fresh multi-MB allocations per layer cost more than the copy itself on CPU). Valid
        until the next call."""
        shape = (rows, *like.shape[1:])
        if self.workspace is not None:
            return self.workspace.buffers(shape, like)
        return like.new_empty(shape), like.new_empty(shape)

    def prefill_mask(self, i: int, sliding_window: int | None, group: int
                     ) -> torch.Tensor | None:
        """Boolean (group * n, L) mask for chunk ``i``: query at position p sees keys
        ``max(0, p - window + 1) .. p``, tiled ``group`` times along the query axis (the
        query heads of a KV group are folded into it). ``None``: plain ``is_causal`` applies."""
        key = (i, sliding_window)
        if key not in self._prefill_masks:
            c = self.prefills[i]
            ctx = c.start_pos + c.num_tokens
            windowed = sliding_window is not None and ctx > sliding_window
            if c.start_pos == 0 and not windowed:
                self._prefill_masks[key] = None
            else:
                dev = self.slot_mapping.device
                qpos = torch.arange(c.start_pos, ctx, device=dev)[:, None]
                kpos = torch.arange(ctx, device=dev)[None, :]
                keep = kpos <= qpos
                if windowed:
                    keep &= kpos > qpos - sliding_window
                self._prefill_masks[key] = keep.repeat(group, 1) if group > 1 else keep
        return self._prefill_masks[key]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry point.

    ``query`` is (1, H, T, hd), ``key``/``value`` (1, KVH, T, hd), all after RoPE. Returns the
    attention output as (1, T, H, hd), as the interface requires.
    """
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, PagedAttentionMetadata):
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs per-step metadata "
                           f"in the {METADATA_KWARG!r} keyword; run the model through ModelRunner")
    layer = meta.kv_caches[module.layer_idx]
    fmt = meta.kv_format
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim ** -0.5

    # (1, KVH, T, hd) -> (T, KVH, hd), the pool's per-slot layout; quantized on the way in.
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    if meta.open_plan is not None:
        kv_quant.write_per_channel(fmt, layer, meta.open_plan, meta.slot_mapping, new_k, new_v,
                                   meta.decode_kernel)
    else:
        kv_quant.write(fmt, layer, meta.slot_mapping, new_k, new_v, meta.decode_kernel)

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    for g in meta.decode_groups:
        n = g.hi - g.lo
        q = query[0, :, g.lo:g.hi].transpose(0, 1).reshape(n, num_kv_heads, group, head_dim)
        if meta.decode_kernel is not None:
            # K/V read in place through the block table: no gather, no padding. It writes
            # straight into `out`: rows lo..hi of it are contiguous (n, H, hd).
            _kernel(meta, layer, q.contiguous(), g.block_tables.view(n, g.max_blocks),
                    g.context_lens, scale, sliding_window,
                    out[0, g.lo:g.hi].view(n, num_kv_heads, group, head_dim))
            continue
        # Gather whole blocks: (n * MB, B, KVH, hd) -> (n, KVH, MB * B, hd). One query per row:
        # the query heads of a KV group are folded into the "query length" axis, so GQA needs
        # no repeated keys: (H, n, hd) -> (n, KVH, G, hd).
        length = g.max_blocks * meta.block_size
        ks, vs = _gather_blocks(meta, layer, g.block_tables, query.dtype)
        ks = ks.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        vs = vs.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        mask = g.mask(meta.block_size, sliding_window, query.dtype)
        o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scaling)
        out[0, g.lo:g.hi] = o.reshape(n, num_heads, head_dim)

    for i, c in enumerate(meta.prefills):
        lo, hi = c.offset, c.offset + c.num_tokens
        q = query[:, :, lo:hi]
        if c.context_slots is not None and (fmt.quantized or c.draft) \
                and meta.decode_kernel is not None:
            # A quantized context, or a draft row's, is read where it lies: each query token is
            # a kernel row over the chunk's one block table, seeing ``start_pos + i + 1`` keys
            # (a draft row's tokens attend as decode rows do, and as the native step runs them).
            assert c.block_table is not None
            n = c.num_tokens
            qr = q[0].transpose(0, 1).reshape(n, num_kv_heads, group, head_dim).contiguous()
            o = out[0, lo:hi].view(n, num_kv_heads, group, head_dim)
            _kernel(meta, layer, qr, c.block_table.view(1, -1), c.query_lens(), scale,
                    sliding_window, o)
            continue
        if c.context_slots is None:
            ks, vs = key[:, :, lo:hi], value[:, :, lo:hi]
        else:
            kc, vc = _gather_slots(meta, layer, c.context_slots, num_kv_heads, query.dtype,
                                   c.block_table)
            ks, vs = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
        mask = meta.prefill_mask(i, sliding_window, group)
        if mask is None:
            o = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, scale=scaling,
                                               enable_gqa=group > 1)
        else:
            # With a mask, enable_gqa would force SDPA's math backend on CUDA; folding each KV
            # group's query heads into the query axis needs neither that nor repeated keys.
            n = c.num_tokens
            qf = q.reshape(1, num_kv_heads, group * n, head_dim)
            o = F.scaled_dot_product_attention(qf, ks, vs, attn_mask=mask, scale=scaling)
            o = o.reshape(1, num_heads, n, head_dim)
        out[0, lo:hi] = o[0].transpose(0, 1)
    return out, None


def _kernel(meta: PagedAttentionMetadata, layer: kv_quant.KVLayer, q: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None,
            out: torch.Tensor) -> None:
    """The CPU kernel over ``layer``'s blocks, float32 or quantized. ``tables`` has one row per
    query row, or a single row all of them share."""
    fmt = meta.kv_format
    if not fmt.quantized:
        meta.decode_kernel.paged_decode_attention(q, layer.k, layer.v, tables, lens, scale,
                                                  window or 0, out)
    elif meta.open_plan is not None:
        meta.decode_kernel.paged_decode_attention_kivi(
            q, layer.k, layer.v, layer.k_params, layer.v_params, layer.k_stage,
            layer.k_stage_scale, meta.open_plan.entry_of, tables, lens, scale, window or 0, out)
    else:
        meta.decode_kernel.paged_decode_attention_quant(
            q, layer.k, layer.v, layer.k_params, layer.v_params, tables, lens, scale,
            window or 0, fmt.bits, out)


def _gather_blocks(meta: PagedAttentionMetadata, layer: kv_quant.KVLayer, blocks: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks ``blocks`` of K and V, in the compute dtype: copied into the workspace, or
    for a quantized pool gathered and dequantized (the torch fallback; the CPU kernel reads
    them in place)."""
    fmt = meta.kv_format
    if not fmt.quantized:
        ks, vs = meta.gather_buffers(blocks.shape[0], layer.k)
        torch.index_select(layer.k, 0, blocks, out=ks)
        torch.index_select(layer.v, 0, blocks, out=vs)
        return ks, vs
    assert layer.k_params is not None and layer.v_params is not None
    if meta.open_plan is not None:
        return (kv_quant.read_keys(layer, blocks, meta.open_plan.entry_of).to(dtype),
                kv_quant.dequantize(fmt, layer.v.index_select(0, blocks),
                                    layer.v_params.index_select(0, blocks), dtype))
    return (kv_quant.dequantize(fmt, layer.k.index_select(0, blocks),
                                layer.k_params.index_select(0, blocks), dtype),
            kv_quant.dequantize(fmt, layer.v.index_select(0, blocks),
                                layer.v_params.index_select(0, blocks), dtype))


def _gather_slots(meta: PagedAttentionMetadata, layer: kv_quant.KVLayer, slots: torch.Tensor,
                  num_kv_heads: int, dtype: torch.dtype, table: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows (S, KVH, hd) at pool slots ``slots``, in the compute dtype (``table``:
    the blocks holding them, for a per-channel format)."""
    fmt = meta.kv_format
    if meta.open_plan is not None:
        # The slots are a context from position 0, in order: whole blocks of it, cut to length.
        assert table is not None
        n = slots.shape[0]
        keys, values = _gather_blocks(meta, layer, table, dtype)
        return (keys.reshape(-1, num_kv_heads, keys.shape[-1])[:n],
                values.reshape(-1, num_kv_heads, values.shape[-1])[:n])
    pairs = []
    for data, params in ((layer.k, layer.k_params), (layer.v, layer.v_params)):
        rows = data.view(-1, num_kv_heads, data.shape[-1]).index_select(0, slots)
        if fmt.quantized:
            assert params is not None
            p = params.view(-1, num_kv_heads, fmt.params).index_select(0, slots)
            rows = kv_quant.dequantize(fmt, rows, p, dtype)
        pairs.append(rows)
    return pairs[0], pairs[1]


def register() -> None:
    """Make ``attn_implementation="vconsole_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
