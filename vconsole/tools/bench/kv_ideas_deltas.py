"""`bench kv-ideas`'s K/V deltas: K (before and after RoPE) and V recomputed with the model for
pairs of blocks, and what a delta of one against the other would cost in bits per value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vconsole.tools.bench.kv_ideas_census import BlockRef


def delta_bits(x: Any, ref: Any) -> float:
    """Mean bits per value a delta ``x - ref`` needs to keep int8's step of ``x`` (per row of
    the last dimension: 8 + log2(max|delta| / max|x|), clamped to 0..8)."""
    import torch

    top = x.abs().amax(-1).clamp_min(1e-12)
    dmax = (x - ref).abs().amax(-1)
    bits = 8 + torch.log2(dmax.clamp_min(1e-30) / top)
    return float(bits.clamp(0, 8).mean())


class KVProbe:
    """K (before and after RoPE) and V of every layer for a token sequence, recomputed with the
    model (`transformers`' own forward, hooks on each layer's k_proj and v_proj). The last
    sequence's are kept, keyed by its token ids (never by its place in a list: the bench probes
    two mixes, and prefixes of one sequence of different lengths)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = model.model.layers
        cfg = model.config
        self.kvh = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._cache: tuple[tuple[int, ...], tuple[list[Any], list[Any], list[Any]]] | None = None

    def kv(self, ids: Sequence[int]) -> tuple[list[Any], list[Any], list[Any]]:
        """Per layer (T, KVH, D): K before RoPE, K after RoPE, V."""
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        key = tuple(ids)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        k_pre: list[Any] = []
        vs: list[Any] = []
        hooks = []
        for layer in self.layers:
            attn = layer.self_attn
            hooks.append(attn.k_proj.register_forward_hook(
                lambda _m, _i, o: k_pre.append(o[0].reshape(o.shape[1], self.kvh, self.hd))))
            hooks.append(attn.v_proj.register_forward_hook(
                lambda _m, _i, o: vs.append(o[0].reshape(o.shape[1], self.kvh, self.hd))))
        try:
            with torch.inference_mode():
                ids_t = torch.tensor([list(ids)], device=self.model.device)
                self.model.model(input_ids=ids_t, use_cache=False)
                pos = torch.arange(len(ids), device=ids_t.device)[None]
                cos, sin = self.model.model.rotary_emb(k_pre[0][None], pos)
                k_post = []
                for k in k_pre:
                    kt = k.transpose(0, 1)[None]          # (1, KVH, T, D)
                    _, kr = apply_rotary_pos_emb(kt, kt, cos, sin)
                    k_post.append(kr[0].transpose(0, 1))
        finally:
            for h in hooks:
                h.remove()
        self._cache = (key, (k_pre, k_post, vs))      # one sequence at a time: memory
        return self._cache[1]


def kv_deltas(probe: KVProbe, seqs: Sequence[Sequence[int]], refs: Sequence[BlockRef],
              block_size: int, *, shifted: bool = False) -> dict[str, Any]:
    """For each (block, reference) pair: relative L2 difference and delta bits of K after RoPE
    (as stored), K before RoPE and V, averaged over layers and pairs; plus per-layer means of
    the relative difference of K before RoPE (layer 0 of equal tokens is identical)."""
    B = block_size
    keys = ("k_rope", "k_pre", "v")
    rel: dict[str, list[float]] = {k: [] for k in keys}
    bits: dict[str, list[float]] = {k: [] for k in keys}
    per_layer: list[list[float]] = []
    pairs = []
    for r in refs:
        a0 = r.index * B
        b0 = r.ref_index if shifted else r.ref_index * B
        pairs.append((r.seq, a0, r.ref_seq, b0))
    by_seq: dict[int, list[Any]] = {}
    for sa, a0, sb, b0 in pairs:     # slices of one sequence at a time (the probe keeps one)
        for s, p in ((sa, a0), (sb, b0)):
            by_seq.setdefault(s, []).append(p)
    slices: dict[tuple[int, int], tuple[list[Any], list[Any], list[Any]]] = {}
    for s, starts in by_seq.items():
        end = max(starts) + B
        k_pre, k_post, v = probe.kv(seqs[s][:end])
        for p in starts:
            slices[(s, p)] = ([t[p:p + B].clone() for t in k_post],
                              [t[p:p + B].clone() for t in k_pre],
                              [t[p:p + B].clone() for t in v])
    for sa, a0, sb, b0 in pairs:
        xa, xb = slices[(sa, a0)], slices[(sb, b0)]
        layer_rel = []
        for name, ta, tb in zip(keys, xa, xb, strict=True):
            for la, lb in zip(ta, tb, strict=True):
                r_ = float((la - lb).norm() / la.norm().clamp_min(1e-12))
                rel[name].append(r_)
                bits[name].append(delta_bits(la, lb))
                if name == "k_pre":
                    layer_rel.append(r_)
        per_layer.append(layer_rel)
    out: dict[str, Any] = {"pairs": len(pairs)}
    if not pairs:
        return out
    for name in keys:
        out[f"{name}_rel_diff"] = round(sum(rel[name]) / len(rel[name]), 4)
        out[f"{name}_delta_bits"] = round(sum(bits[name]) / len(bits[name]), 2)
    n_layers = len(per_layer[0])
    means = [sum(p[i] for p in per_layer) / len(per_layer) for i in range(n_layers)]
    out["k_pre_rel_diff_by_layer"] = {str(i): round(means[i], 3)
                                      for i in sorted({0, 1, 2, n_layers // 2, n_layers - 1})}
    return out

