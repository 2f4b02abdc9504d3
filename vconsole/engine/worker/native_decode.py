"""A decode step without Python per layer (issue #47): one native call runs every layer.

`FusedDecoder.forward` issues some 40 torch calls per layer from Python (norms, RoPE, views, the
KV write, the attention, adds, SiLU); on SmolLM2 (30 layers, hidden 576) with its GGUF blocks
that Python and dispatch took about as long as the matmuls themselves (measured before this
path: one thread, one stream, the decoder 18.9 ms a step of which the 120 GGUF linears alone
9.4 ms). For a step of 1-8 decode (or draft) rows `NativeDecode` hands the whole layer loop to
``csrc/decode_step.cpp``: the model's tensors are packed once (`build`: no copy, the plan holds
references), and each step is one ``decode_step`` call with the embedded rows, RoPE's cos/sin
from transformers' rotary module, and the rows' slots, block tables and context lengths. The
linears and the attention run the kernels the Python path runs (this build's ``gguf_linear``,
``at::linear`` for float32 weights, ``_weight_int8pack_mm`` for int8, the float32 paged
attention kernel); the elementwise work is C++ loops doing the Python path's operations in its
order with IEEE rounding, and the two reductions whose rounding is torch's own vector code (the
RMSNorm's mean, SiLU) call torch, so a step's hidden states are the Python path's bit for bit
and so are the tokens (`tests/engine/worker/test_native_decode.py`), int8 weights' bfloat16
activations included.

Why our own loop and not a compiled graph (torch.compile / AOTInductor), measured on the same
SmolLM2 step (docs/benchmarks.md, "A decode step without Python per layer"): the step written as
one function over the same kernels, wrapped as ``torch.library`` custom ops with fake kernels,
compiled by Inductor with no graph break in 35-76 s, ran at 35 ms against 14 ms for the Python
layers and 8.2 ms for this call (and 190 ms with the KV pool declared mutated, which
functionalization copied); its elementwise fusion also changes the rounding. AOTInductor would
add an export with dynamic block-table and pool sizes and a compile per model and CPU, to reach
at best what this loop does: the same opaque kernel calls with the elementwise work between
them. The loop is exact, and needs nothing compiled beyond the extension the engine builds.

Which steps take it (`takes`): CPU, float32 KV pool (``--kv-cache-dtype auto``), 1 to
`MAX_ROWS` rows of decode and draft rows only (no prefill chunk), no NVTX ranges wanted; the
fused decoder's linears all float32, all int8, or all GGUF with each stacked linear of one quant
type. A plan with int8 linears runs at most ``weight_quant.SMALL_ROWS`` (4) rows: past them the
Python path leaves ``_weight_int8pack_mm`` for a bfloat16 GEMM the loop does not mirror
(`NativeDecode.max_rows`). Every other step (prefill, wider batches, quantized KV, CUDA) runs
`FusedDecoder`'s Python layers, which stay the reference and the debugging path.
``VCONSOLE_DECODE_STEP=python`` keeps every step on them (the before/after of the benchmarks;
``native``, the default, and ``python`` are the only values: another is refused at start); the
path in use is `FusedDecoder.decode_step` (``native`` or ``python``), logged at start (``decode
and draft steps of 1-8 rows: native (30 layers, GGUF blocks)``, or ``python (why)``), and the
native call is the ``decode_step`` layer type and operator in a profile.

**Draft rows** (speculative decoding, `spec_verify`): a request's 1 + k verification tokens are
1 + k decode rows of that request at consecutive positions, each with its own slot, the
request's block table and the context up to its own position (``pos + 1``). The runner builds
that view of a step of decode and draft rows (`PagedAttentionMetadata.decode_view`); the native
loop writes every row's K/V before any row attends, so each row reads the drafts before it and
not those after it, as causal verification needs. The Python path attends such a row with the
same per-row kernel (`paged_attention`), so both give the same logits, bit for bit, in the order
`spec_verify` reads them (the sample rows').

Threads: the native plan serialises its steps with a lock of its own (its GGUF output buffers
are reused from step to step), so two threads stepping one model run one after the other; the
engine runs one step at a time anyway. `NativeDecode.forward` repoints the plan at a new pool
before stepping; two threads with two different pools on one plan are not supported.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vconsole.engine.worker import gguf_linear, weight_quant
from vconsole.engine.worker.gguf_linear import GGUFLinear
from vconsole.engine.worker.paged_attention import DecodeGroup, PagedAttentionMetadata
from vconsole.engine.worker.weight_quant import Int8Linear

if TYPE_CHECKING:
    from vconsole.engine.worker.fused_decoder import FusedDecoder

DECODE_STEP_ENV = "VCONSOLE_DECODE_STEP"    # "python": every step through the Python layers
DECODE_STEP_VALUES = ("native", "python")
# The widest step the native path runs (the GGUF GEMV's width, csrc/gguf_gemm.cpp kGemvRows;
# csrc/decode_step.cpp's kMaxRows): wider steps stay Python. A plan with int8 linears stops at
# weight_quant.SMALL_ROWS (`NativeDecode.max_rows`).
MAX_ROWS = 8
_FLOAT, _GGUF, _INT8 = 0, 1, 2


def wanted() -> bool:
    """Whether ``VCONSOLE_DECODE_STEP`` asks for the native step (``native``, the default) or
    the Python layers (``python``); ValueError for any other value (unset or empty: native)."""
    value = os.environ.get(DECODE_STEP_ENV, "").strip()
    if value not in ("", *DECODE_STEP_VALUES):
        raise ValueError(f"{DECODE_STEP_ENV}={value!r}: expected one of "
                         f"{', '.join(DECODE_STEP_VALUES)}")
    return value != "python"


def _linear_parts(fn: Any) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """(kind, weight, bias, int8 scale, GGUF quant type) of a fused-decoder linear callable, or
    None for one the native step does not run as the Python path does: a concatenation of GGUF
    parts of two types, int8 weights on our int8 kernel (CPUs without native bfloat16; here
    only ``_weight_int8pack_mm`` is mirrored)."""
    empty = torch.empty(0)
    if isinstance(fn, functools.partial) and fn.func is F.linear and not fn.args:
        weight, bias = fn.keywords["weight"], fn.keywords.get("bias")
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            return None
        return _FLOAT, weight, empty if bias is None else bias.float().contiguous(), empty, 0
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, GGUFLinear) and fn.__func__ is GGUFLinear.forward:
        bias = owner.bias
        return (_GGUF, owner.blocks, empty if bias is None else bias.data.contiguous(), empty,
                owner.qtype)
    if isinstance(owner, Int8Linear) and fn.__func__ is Int8Linear.forward:
        if weight_quant.many_rows_path().gemm is not None:
            return None     # int8 linears run our int8 kernel at every width: not mirrored here
        bias = owner.bias
        return (_INT8, owner._weight_in("plain"),
                empty if bias is None else bias.data.float().contiguous(), owner.scale_bf16, 0)
    return None


class NativeDecode:
    """The packed model (a handle into ``csrc/decode_step.cpp``'s registry, freed with this
    object) and its step."""

    def __init__(self, ops: Any, handle: int, fused: FusedDecoder, max_rows: int) -> None:
        self._ops = ops
        self._handle = handle
        self._fused = fused
        self.max_rows = max_rows       # the widest step this plan runs (`MAX_ROWS`, int8: 4)
        self._pools: Any = None        # the runner's kv_caches list the plan points at
        weakref.finalize(self, ops.decode_plan_free, handle)

    @classmethod
    def build(cls, fused: FusedDecoder, kernel: Any) -> tuple[NativeDecode | None, str]:
        """The native step over ``fused``'s weights, or None and why not."""
        if not wanted():
            return None, f"{DECODE_STEP_ENV}=python"
        if kernel is None:
            return None, "no CPU kernel build"
        ops = getattr(torch.ops, kernel.namespace)
        if not hasattr(ops, "decode_step"):
            return None, "the kernel build has no decode_step"
        if fused.embed.weight.device.type != "cpu" or fused.norm_w.dtype != torch.float32:
            return None, "CPU float32 models only"
        tensors: list[torch.Tensor] = [fused.norm_w.detach().contiguous()]
        ints = [fused.num_heads, fused.num_kv_heads, fused.head_dim,
                int(fused.norm_w.shape[0]), 0, len(fused.layers), MAX_ROWS]
        floats = [float(fused.scaling), float(fused.norm_eps)]
        kinds: set[int] = set()
        for layer in fused.layers:
            parts = [_linear_parts(f) for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in parts):
                return None, ("int8 linears on the int8 kernel, or a stacked linear of GGUF "
                              "parts of two types: not mirrored natively")
            if any(p[0] == _GGUF for p in parts if p is not None) \
                    and gguf_linear.kernel().namespace != kernel.namespace:
                return None, "the GGUF linears run another kernel build"
            if layer.ln1.dtype != torch.float32 or layer.ln2.dtype != torch.float32:
                return None, "CPU float32 models only"
            ints.append(int(layer.sliding_window or 0))
            tensors += [layer.ln1.detach().contiguous(), layer.ln2.detach().contiguous()]
            floats += [layer.ln1_eps, layer.ln2_eps]
            for part in parts:
                assert part is not None
                kind, weight, bias, scale, qtype = part
                kinds.add(kind)
                ints += [kind, qtype]
                tensors += [weight, bias, scale]
            ints[4] = _in_features(layer.down, parts[3][1] if parts[3] else None)
        max_rows = min(MAX_ROWS, weight_quant.SMALL_ROWS) if _INT8 in kinds else MAX_ROWS
        ints[6] = max_rows
        try:
            handle = int(ops.decode_plan(tensors, ints, floats))
        except RuntimeError as e:
            return None, str(e).splitlines()[0]
        names = sorted({("float32", "GGUF blocks", "int8")[k] for k in kinds})
        rows = f", up to {max_rows} rows" if max_rows < MAX_ROWS else ""
        return (cls(ops, handle, fused, max_rows),
                f"{len(fused.layers)} layers, {' + '.join(names)}{rows}")

    @staticmethod
    def takes(meta: PagedAttentionMetadata, num_tokens: int, max_rows: int = MAX_ROWS) -> bool:
        """Whether a step runs natively: 1 to ``max_rows`` rows (`MAX_ROWS`; a plan's own is
        `NativeDecode.max_rows`), decode rows in one group or decode and draft rows seen as
        decode rows (`PagedAttentionMetadata.decode_view`), no prefill chunk, a float32 pool
        read by the CPU kernel."""
        if not (0 < num_tokens <= min(max_rows, MAX_ROWS) and meta.decode_kernel is not None
                and not meta.kv_format.quantized and meta.open_plan is None):
            return False
        view = _view(meta)
        return view is not None and view.lo == 0 and view.hi == num_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """`FusedDecoder.forward` for a step `takes` accepts: the final-normed hidden states
        of rows ``rows``."""
        fused = self._fused
        if meta.kv_caches is not self._pools:
            self._ops.decode_plan_pools(self._handle, [layer.k for layer in meta.kv_caches],
                                        [layer.v for layer in meta.kv_caches])
            self._pools = meta.kv_caches
        h = fused.embed(input_ids)                                   # (R, hidden)
        cos, sin = fused.rotary(h[None], positions[None])            # (1, R, hd) each
        return self.layers(h, cos[0].contiguous(), sin[0].contiguous(), meta).index_select(
            0, rows)

    def layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: PagedAttentionMetadata) -> torch.Tensor:
        """The native call: every layer and the final norm, (R, hidden) -> (R, hidden) (the
        profiler's ``decode_step`` range)."""
        g = _view(meta)
        assert g is not None
        n = g.hi - g.lo
        return self._ops.decode_step(self._handle, h, cos, sin, meta.slot_mapping,  # type: ignore[no-any-return]
                                     g.block_tables.view(n, g.max_blocks), g.context_lens)


def _view(meta: PagedAttentionMetadata) -> DecodeGroup | None:
    """The step's rows as decode rows: its one decode group when it has only decode rows, the
    runner's `PagedAttentionMetadata.decode_view` when it has draft rows too; None for any
    other step (a prefill chunk, decode rows in several groups)."""
    if meta.prefills:
        return meta.decode_view
    if meta.num_decodes and len(meta.decode_groups) == 1:
        return meta.decode_groups[0]
    return None


def _in_features(down: Any, weight: torch.Tensor | None) -> int:
    """The MLP's intermediate width: the down projection's input (a module's ``in_features``,
    else its float weight's columns)."""
    owner = getattr(down, "__self__", None)
    if owner is not None:
        return int(owner.in_features)
    assert weight is not None
    return int(weight.shape[1])
