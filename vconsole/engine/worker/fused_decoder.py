"""Our own decoder forward for the Llama family (llama, qwen2, mistral), over transformers' weights.

transformers' decoder is written for every use (caches, masks, kwargs plumbing, an attention
interface lookup per layer); one packed engine step needs none of that, and on a small model the
Python around the ops costs as much as the ops. `FusedDecoder` runs the same math as
`LlamaDecoderLayer` with fewer, larger ops, as vLLM's model files do:

- q/k/v are one matmul (``qkv_proj``) and gate/up one matmul (``gate_up_proj``): the weights are
  concatenated once at load, and transformers' ``q_proj`` / ``k_proj`` / ... weights become views
  into the fused tensors (no second copy; transformers' own forward still works on them);
- RoPE is applied to q and k in one pass, with the cos/sin of transformers' own rotary module
  (so every rope scaling it knows applies);
- the attention is `paged_attention.paged_attention_forward`, called directly;
- each layer's four matmuls are callables (``qkv``, ``o``, ``gate_up``, ``down``): ``F.linear``
  over the float weights, or, with ``--quantization int8``, the fused `weight_quant.Int8Linear`
  (stacked from the int8 parts exactly; transformers' q/k/v and gate/up modules become
  `weight_quant.SliceOf` views of its output), or, with ``--quantization gguf``, the GGUF
  blocks' `gguf_linear.GGUFLinear` (stacked the same way where the parts share a quant type).

The elementwise math (RMSNorm in float32, ``q * cos + rotate_half(q) * sin``, ``act(gate) * up``)
is written as transformers writes it, so greedy outputs stay token-for-token equal to theirs
(`tests/engine/worker/test_fused_decoder.py` checks logits and tokens against transformers' own
forward). `build` returns None for anything it does not know (another architecture, an activation
other than SiLU, linears replaced by `cpu_linear` or mixed float and int8), and the runner keeps
transformers' forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from vconsole.engine.worker import gguf_linear, nvtx
from vconsole.engine.worker.gguf_linear import GGUFLinear
from vconsole.engine.worker.native_decode import MAX_ROWS, NativeDecode
from vconsole.engine.worker.paged_attention import PagedAttentionMetadata, paged_attention_forward
from vconsole.engine.worker.weight_quant import Int8Linear, SliceOf

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor], torch.Tensor]

FUSABLE_MODEL_TYPES = ("llama", "qwen2", "mistral")
_LAYER_RANGES = tuple(f"layer {i}" for i in range(256))    # NVTX range names, made once


@dataclass
class _Layer:
    attn: torch.nn.Module           # transformers' attention module: layer_idx for the pool
    ln1: torch.Tensor
    ln1_eps: float
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    ln2_eps: float
    gate_up: Linear
    down: Linear
    sliding_window: int | None
    # The float weights the float callables close over (None with int8 linears).
    qkv_w: torch.Tensor | None = None
    qkv_b: torch.Tensor | None = None
    gate_up_w: torch.Tensor | None = None


def _dense(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return partial(F.linear, weight=weight, bias=bias)


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output axis and point each
    linear's parameters at its slice of the result."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([lin.bias.data if lin.bias is not None
                          else lin.weight.new_zeros(lin.out_features) for lin in linears])
    at = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = weight[at:at + n]
        if lin.bias is not None and bias is not None:
            lin.bias.data = bias[at:at + n]
        at += n
    return weight, bias


def _fuse_int8(owner: torch.nn.Module, names: list[str]) -> Int8Linear:
    """Stack ``owner``'s int8 linears ``names`` into one and replace each by a `SliceOf` it
    (one int8 copy of the weights, not two)."""
    parts = [getattr(owner, n) for n in names]
    fused = Int8Linear.concat(parts)
    at = 0
    for name, part in zip(names, parts, strict=True):
        setattr(owner, name, SliceOf(fused, at, at + part.out_features))
        at += part.out_features
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedDecoder:
    """``forward(input_ids (T,), positions (T,), metadata, rows) -> hidden states (R, hidden)``
    of the packed batch's rows ``rows`` after the final norm (only the rows the runner samples
    are normed); the runner applies the LM head."""

    def __init__(self, model: Any, layers: list[_Layer]) -> None:
        decoder = model.get_decoder()
        cfg = model.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm_w = decoder.norm.weight
        self.norm_eps = float(decoder.norm.variance_epsilon)
        self.layers = layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = float(layers[0].attn.scaling) if layers else self.head_dim ** -0.5
        # The native decode step (`native_decode`) for small pure-decode steps, once
        # `use_native` found it can run this model; else every step runs the layers below.
        self.native: NativeDecode | None = None
        self.native_reason = "not tried"
        self.last_native = False        # whether the last forward ran the native step

    def use_native(self, kernel: Any) -> str:
        """Run steps of up to `native_decode.MAX_ROWS` decode and draft rows (no prefill
        chunk) in one native call when ``kernel`` (the CPU attention kernel's build, or None)
        and the weights allow; returns the path now in use for them (`decode_step`)."""
        self.native, self.native_reason = NativeDecode.build(self, kernel)
        rows = self.native.max_rows if self.native is not None else MAX_ROWS
        log.info("decode and draft steps of 1-%d rows: %s (%s)", rows, self.decode_step,
                 self.native_reason)
        return self.decode_step

    @property
    def decode_step(self) -> str:
        """How small steps of decode and draft rows run: ``native`` (one call for every
        layer) or ``python`` (the layers below)."""
        return "native" if self.native is not None else "python"

    @classmethod
    def build(cls, model: Any) -> FusedDecoder | None:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in FUSABLE_MODEL_TYPES \
                or getattr(cfg, "hidden_act", "silu") != "silu":
            return None
        decoder = model.get_decoder()
        layers: list[_Layer] = []
        kinds = set()
        for layer in decoder.layers[:cfg.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                     mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            kinds |= {type(p) for p in parts}
        if kinds not in ({torch.nn.Linear}, {Int8Linear}, {GGUFLinear}):
            return None  # packed by cpu_linear, mixed, already fused, ...: transformers' path
        int8 = kinds == {Int8Linear}
        stored = kinds == {GGUFLinear}
        for layer in decoder.layers[:cfg.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            window = (attn.sliding_window if hasattr(attn, "sliding_window")
                      else getattr(cfg, "sliding_window", None))
            norms = dict(attn=attn, ln1=layer.input_layernorm.weight,
                         ln1_eps=float(layer.input_layernorm.variance_epsilon),
                         ln2=layer.post_attention_layernorm.weight,
                         ln2_eps=float(layer.post_attention_layernorm.variance_epsilon),
                         sliding_window=window)
            if stored:
                layers.append(_Layer(
                    qkv=gguf_linear.fuse(attn, ["q_proj", "k_proj", "v_proj"]),
                    o=attn.o_proj.forward,
                    gate_up=gguf_linear.fuse(mlp, ["gate_proj", "up_proj"]),
                    down=mlp.down_proj.forward, **norms))
                continue
            if int8:
                layers.append(_Layer(
                    qkv=_fuse_int8(attn, ["q_proj", "k_proj", "v_proj"]).forward,
                    o=attn.o_proj.forward,
                    gate_up=_fuse_int8(mlp, ["gate_proj", "up_proj"]).forward,
                    down=mlp.down_proj.forward, **norms))
                continue
            qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up_w, gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj])
            layers.append(_Layer(
                qkv=_dense(qkv_w, qkv_b), o=_dense(attn.o_proj.weight, attn.o_proj.bias),
                gate_up=_dense(gate_up_w, gate_up_b),
                down=_dense(mlp.down_proj.weight, mlp.down_proj.bias),
                qkv_w=qkv_w, qkv_b=qkv_b, gate_up_w=gate_up_w, **norms))
        return cls(model, layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        native = self.native
        if native is not None and (nvtx.ON or not NativeDecode.takes(
                meta, input_ids.shape[0], native.max_rows)):
            native = None
        self.last_native = native is not None      # the step's regime, in its step record
        if native is not None:
            return native.forward(input_ids, positions, meta, rows)
        h = self.embed(input_ids)                                    # (T, hidden)
        cos, sin = self.rotary(h[None], positions[None])             # (1, T, hd) each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]            # (T, 1, hd)
        if nvtx.ON:                 # checked once a step: the plain loop runs without ranges
            return self._forward_in_ranges(h, cos, sin, meta, rows)
        for layer in self.layers:
            h = h + self.attention(layer, self.norm(h, layer.ln1, layer.ln1_eps), cos, sin, meta)
            h = h + self.mlp(layer, self.norm(h, layer.ln2, layer.ln2_eps))
        return self.norm(h.index_select(0, rows), self.norm_w, self.norm_eps)

    def _forward_in_ranges(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           meta: PagedAttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """`forward`'s layers, each in an NVTX range ``layer I`` (`vconsole.engine.worker.
        nvtx`)."""
        for i, layer in enumerate(self.layers):
            nvtx.push(_LAYER_RANGES[i] if i < len(_LAYER_RANGES) else f"layer {i}")
            try:
                h = h + self.attention(layer, self.norm(h, layer.ln1, layer.ln1_eps), cos, sin,
                                       meta)
                h = h + self.mlp(layer, self.norm(h, layer.ln2, layer.ln2_eps))
            finally:
                nvtx.pop()
        return self.norm(h.index_select(0, rows), self.norm_w, self.norm_eps)

    # The pieces are methods so that the profiler can label them (`StepProfiler` wraps them on
    # the instance while it runs, as it hooks transformers' modules).

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm, op for op (float32 statistics)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  meta: PagedAttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        k_end = (nh + nkv) * hd
        qkv = layer.qkv(x)                  # (T, (H + 2 KVH) hd)
        qk = qkv[:, :k_end].view(t, nh + nkv, hd)
        qk = qk * cos + _rotate_half(qk) * sin                       # RoPE on q and k at once
        q = qk[:, :nh].transpose(0, 1)[None]                         # (1, H, T, hd)
        k = qk[:, nh:].transpose(0, 1)[None]                         # (1, KVH, T, hd)
        v = qkv[:, k_end:].view(t, nkv, hd).transpose(0, 1)[None]
        out, _ = paged_attention_forward(layer.attn, q, k, v, None, scaling=self.scaling,
                                         sliding_window=layer.sliding_window,
                                         paged_metadata=meta)
        return layer.o(out.view(t, nh * hd))

    @staticmethod
    def mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
