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
   a chunk that starts at position 0, directly over its fresh K/V, which are bit-identical).

No attention mask is built by transformers: ``vconsole_paged`` is deliberately *not* registered
in ``AttentionMaskInterface``, which makes ``create_causal_mask`` return ``None`` at once (the
path transformers keeps for vLLM/TGI-style backends) and skips its packed-sequence detection,
a device sync per forward. Masking is done here, from positions.

Pool layout per layer: ``(k, v)``, each ``(num_blocks, block_size, num_kv_heads, head_dim)``,
zero-initialised. Zeros matter: padded decode rows read stale-but-finite slots that the mask
drops; uninitialised memory could hold NaN, and ``0 * NaN`` would leak through the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "vconsole_paged"
METADATA_KWARG = "paged_metadata"

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


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
    k_pool, v_pool = meta.kv_caches[module.layer_idx]
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads

    # (1, KVH, T, hd) -> (T, KVH, hd), the pool's per-slot layout.
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    k_flat = k_pool.view(-1, num_kv_heads, head_dim)
    v_flat = v_pool.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, new_k)
    v_flat.index_copy_(0, meta.slot_mapping, new_v)

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    for g in meta.decode_groups:
        n = g.hi - g.lo
        if meta.decode_kernel is not None:
            # K/V read in place through the block table: no gather, no padding.
            # It writes straight into `out`: rows lo..hi of it are contiguous (n, H, hd).
            q = query[0, :, g.lo:g.hi].transpose(0, 1).reshape(n, num_kv_heads, group, head_dim)
            meta.decode_kernel.paged_decode_attention(
                q.contiguous(), k_pool, v_pool, g.block_tables.view(n, g.max_blocks),
                g.context_lens, scaling if scaling is not None else head_dim ** -0.5,
                sliding_window or 0, out[0, g.lo:g.hi].view(n, num_kv_heads, group, head_dim))
            continue
        length = g.max_blocks * meta.block_size
        # Gather whole blocks: (n * MB, B, KVH, hd) -> (n, KVH, MB * B, hd).
        ks, vs = meta.gather_buffers(g.block_tables.shape[0], k_pool)
        torch.index_select(k_pool, 0, g.block_tables, out=ks)
        torch.index_select(v_pool, 0, g.block_tables, out=vs)
        ks = ks.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        vs = vs.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        # One query per row: fold the query heads of a KV group into the "query length" axis,
        # so GQA needs no repeated keys: (H, n, hd) -> (n, KVH, G, hd).
        q = query[0, :, g.lo:g.hi].transpose(0, 1).reshape(n, num_kv_heads, group, head_dim)
        mask = g.mask(meta.block_size, sliding_window, query.dtype)
        o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scaling)
        out[0, g.lo:g.hi] = o.reshape(n, num_heads, head_dim)

    for i, c in enumerate(meta.prefills):
        lo, hi = c.offset, c.offset + c.num_tokens
        q = query[:, :, lo:hi]
        if c.context_slots is None:
            ks, vs = key[:, :, lo:hi], value[:, :, lo:hi]
        else:
            ks = k_flat.index_select(0, c.context_slots).transpose(0, 1)[None]
            vs = v_flat.index_select(0, c.context_slots).transpose(0, 1)[None]
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


def register() -> None:
    """Make ``attn_implementation="vconsole_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
