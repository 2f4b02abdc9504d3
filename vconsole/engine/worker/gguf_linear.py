"""GGUF quantized weights read as stored (``--quantization gguf``, issue #47).

A GGUF file's linears are blocks of quantized weights: SmolLM2's is Q4_1, 0.625 bytes a weight
against float32's 4, and one decode step of a single stream reads every weight once, so the
bytes are the step's time. The float path (``--dtype float32``) dequantizes the file once into
a float32 model (`gguf_model`); this one keeps each linear's blocks as they lie in the file and
multiplies with our own kernels (``csrc/gguf_gemm.cpp``): a GEMV for steps of up to 8 rows that
decodes each group of 32 weights in registers, and a GEMM for larger steps that decodes a
panel of channels into a buffer kept in cache. Activations stay float32 and sums are float32,
so a `GGUFLinear`'s output equals ``x @ dequantize(W).T`` up to float rounding: the model gives
the tokens of its dequantized float copy (the float path), whatever the quant type.

Quant types read: `SUPPORTED` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K). A linear stored as float (F32,
F16, BF16) stays a float ``nn.Linear``; any other type is refused with the supported list.

How a model is built: the float model is loaded as for ``--dtype float32`` (config, tokenizer,
norms and the embedding come from it), then each decoder linear and the LM head is replaced by
a `GGUFLinear` over the file's tensor (``blk.N.attn_q`` ... ``ffn_down``; ``output``, or the
tied ``token_embd``). llama.cpp's converter stores a Llama's q and k rows permuted for its
rotary layout; the rows a tensor needs are found by comparing its decoded weights with the
float model's (the order transformers' reader restored), so the replacement is checked
weight for weight at load and a mismatch is an error, never a wrong model.

The vector path is the attention kernel's build (`attention_kernel`, compiled for this CPU:
``avx512``, ``avx2`` or ``generic``); `use_kernel` sets another build (the tests run every
path). Without a C++ compiler a defaulted ``gguf`` falls back to the float path with a warning;
an explicit one is an error.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# ggml's type ids of the quant types the kernels read, by name.
SUPPORTED = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
FLOAT_TYPES = ("F32", "F16", "BF16")
# Weights per block and bytes per block of each supported type.
BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}
TYPE_NAMES = {v: k for k, v in SUPPORTED.items()}
# GGUF tensor names of a decoder layer's linears, by transformers' module path in the layer.
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
# A weight decoded by the kernel against transformers' (numpy's) decoding of the same block:
# one rounding apart at most (a fused multiply-add against a multiply then an add).
LOAD_RTOL = 2e-6
CHECK_ROWS = 4096

_lock = threading.Lock()
_kernel: Any = None
_last_reader: dict[str, Any] = {}


def use_kernel(kernel: Any) -> None:
    """Run every `GGUFLinear` on ``kernel`` (an `attention_kernel.Kernel`; None: the native
    build, loaded on next use): the tests' way to run each vector path."""
    global _kernel
    with _lock:
        _kernel = kernel


def kernel() -> Any:
    """The kernel build in use (the native one, built or loaded on first use); raises when it
    cannot be built."""
    global _kernel
    with _lock:
        if _kernel is None:
            from vconsole.engine.worker import attention_kernel

            _kernel = attention_kernel.build()
        return _kernel


def vector_path() -> str:
    """The kernels' vector path: avx512, avx2 or generic."""
    return str(kernel().int8_gemm_isa())


def row_bytes(qtype: int, k: int) -> int:
    per, size = BLOCKS[qtype]
    return k // per * size


class GGUFLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` the GGUF blocks ``blocks`` ((N, row bytes) uint8) of
    type ``qtype`` holding ``in_features`` weights a row."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qtype not in BLOCKS:
            raise ValueError(f"GGUF quant type {qtype} is not read here; supported: "
                             f"{', '.join(SUPPORTED)}")
        per, _ = BLOCKS[qtype]
        if in_features % per:
            raise ValueError(f"{TYPE_NAMES[qtype]} rows hold whole blocks of {per} weights; "
                             f"in_features is {in_features}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"{TYPE_NAMES[qtype]} blocks of {in_features} weights a row are "
                             f"(N, {row_bytes(qtype, in_features)}) uint8; got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        bias = None if bias is None else bias.detach().float().contiguous()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @classmethod
    def concat(cls, linears: Sequence[GGUFLinear]) -> GGUFLinear:
        """The linears stacked along the output axis (their rows side by side: one type and
        one ``in_features``)."""
        first = linears[0]
        if any(lin.qtype != first.qtype or lin.in_features != first.in_features
               for lin in linears):
            raise ValueError("only linears of one quant type and width stack")
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.data if lin.bias is not None
                              else torch.zeros(lin.out_features) for lin in linears])
        return cls(torch.cat([lin.blocks for lin in linears]), first.qtype, first.in_features,
                   bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weights as float32 (out_features, in_features), decoded by the kernel."""
        out = torch.empty(self.out_features, self.in_features)
        kernel().gguf_dequantize(self.blocks, self.qtype, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        kernel().gguf_linear(x2, self.blocks, self.qtype, y)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.type_name} as stored")


@dataclass(frozen=True)
class Summary:
    """What `load_into` did: linears replaced (by quant type), kept float, bytes held."""

    replaced: dict[str, int]
    kept_float: int
    weight_bytes: int
    label: str = "gguf"       # int4: a float model's linears quantized at load (`int4_weights`)

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.replaced.items()))
        kept = f", {self.kept_float} float" if self.kept_float else ""
        kernels = " on the gguf kernels" if self.label != "gguf" else ""
        return f"{self.label} · {kinds}{kept}{kernels} · {vector_path()}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its ggml type id, its dims (the row length first, as the
    file stores them) and its bytes in the file."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    data: np.ndarray

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return str(gguf.GGMLQuantizationType(self.type_id).name)
        except ValueError:
            return f"type {self.type_id}"


# GGUF metadata value types of a fixed size (bytes), by type id; 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensors(gguf_file: Path) -> dict[str, TensorInfo]:
    """The file's tensor table, its data mapped (not read). The metadata is skipped, not
    parsed: gguf's reader builds a numpy view per token of the vocabulary (SmolLM2's 49,152
    and their merges: seconds), and only ``general.alignment`` is wanted here."""
    import struct

    raw = np.memmap(gguf_file, dtype=np.uint8, mode="r")
    buf = memoryview(raw)           # type: ignore[arg-type]
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{str(gguf_file)!r} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{str(gguf_file)!r} is GGUF version {version}; 2 or later is read")
    pos = 24
    alignment = 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind: int, at: int) -> int:
        if kind in _FIXED:
            return at + _FIXED[kind]
        if kind == 8:
            (n,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + n
        if kind == 9:
            sub, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if sub in _FIXED:
                return at + count * _FIXED[sub]
            for _ in range(count):
                at = skip(sub, at)
            return at
        raise ValueError(f"{str(gguf_file)!r}: unknown metadata value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = skip(kind, pos)
    table = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        table.append((name, type_id, tuple(int(d) for d in dims), offset))
    start = -(-pos // alignment) * alignment
    out: dict[str, TensorInfo] = {}
    for name, type_id, dims, offset in table:
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if type_id in BLOCKS:
            size = rows * row_bytes(type_id, dims[0])
        elif type_id in (0, 1, 30):            # F32, F16, BF16
            size = rows * dims[0] * (4 if type_id == 0 else 2)
        else:
            size = 0                           # a type not read here: its bytes are not needed
        out[name] = TensorInfo(name, type_id, dims, raw[start + offset:start + offset + size])
    return out


_LAYER_TENSOR = re.compile(r"blk\.\d+\.(" + "|".join(LAYER_TENSORS.values()) + r")\.weight")


def quantized_linears(tensors: dict[str, TensorInfo]) -> dict[str, str]:
    """The tensors `load_into` replaces (the decoder layers' linears and the LM head: ``output``,
    else the tied ``token_embd``) that are not stored as float, by name: their type's name.
    The input embedding is not among them: it runs its float conversion whatever its type."""
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return {t.name: t.type_name for t in tensors.values()
            if (t.name == head or _LAYER_TENSOR.fullmatch(t.name))
            and t.type_name not in FLOAT_TYPES}


def unsupported_types(gguf_file: Path) -> list[str]:
    """The quant types of the file's replaced tensors that the kernels do not read."""
    return sorted({t for t in quantized_linears(_reader(gguf_file)).values()
                   if t not in SUPPORTED})


def quantized_types(gguf_file: Path) -> list[str]:
    """The quant types of the file's replaced tensors (none: a float GGUF)."""
    return sorted(set(quantized_linears(_reader(gguf_file)).values()))


def _reader(gguf_file: Path) -> dict[str, TensorInfo]:
    """The file's tensor table, the last one read kept (the start asks twice: which weights,
    then the tensors)."""
    st = gguf_file.stat()
    key = (str(gguf_file.resolve()), st.st_size, st.st_mtime_ns)
    with _lock:
        if _last_reader.get("key") != key:
            _last_reader.clear()
            _last_reader.update(key=key, tensors=read_tensors(gguf_file))
        return _last_reader["tensors"]  # type: ignore[no-any-return]


def forget_reader() -> None:
    with _lock:
        _last_reader.clear()


def is_quantized(gguf_file: Path) -> bool:
    """Whether the file's linears are stored quantized (any of them)."""
    return bool(quantized_linears(_reader(gguf_file)))


def _row_orders(n: int, config: Any, gguf_name: str) -> list[np.ndarray]:
    """The row orders a tensor may need: as stored, then (q and k) the inverse of llama.cpp's
    rotary permutation (as transformers' GGUF reader undoes it)."""
    orders = [np.arange(n)]
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for key, h in (("attn_q", heads), ("attn_k", kv_heads)):
        if gguf_name.endswith(f".{key}.weight") and h and n % (2 * h) == 0:
            orders.append(np.arange(n).reshape(h, n // h // 2, 2).swapaxes(2, 1).reshape(n))
    return orders


def _matching(blocks: torch.Tensor, qtype: int, k: int, float_weight: torch.Tensor,
              orders: list[np.ndarray], what: str) -> torch.Tensor:
    """``blocks`` with its rows in the order whose decoded weights are ``float_weight``'s
    (compared `CHECK_ROWS` rows at a time: the LM head is 113 MB decoded)."""
    want = float_weight.detach()
    n = blocks.shape[0]
    if tuple(want.shape) != (n, k):
        raise ValueError(f"{what}: the GGUF tensor is ({n}, {k}), the model's "
                         f"{tuple(want.shape)}")
    for order in orders:
        idx = torch.from_numpy(order)
        candidate = blocks if bool((idx == torch.arange(n)).all()) \
            else blocks.index_select(0, idx)
        decoded = torch.empty(min(CHECK_ROWS, n), k)
        head = decoded[:min(8, n)]          # a wrong order shows in its first rows
        kernel().gguf_dequantize(candidate[:head.shape[0]], qtype, head)
        if not bool(torch.isclose(head, want[:head.shape[0]], rtol=LOAD_RTOL, atol=0.0).all()):
            continue
        for lo in range(0, n, CHECK_ROWS):
            hi = min(lo + CHECK_ROWS, n)
            got = decoded[:hi - lo]
            kernel().gguf_dequantize(candidate[lo:hi], qtype, got)
            part = want[lo:hi]      # equal as a rule (one rounding the same way): cheap
            if not torch.equal(got, part) and not bool(
                    torch.isclose(got, part, rtol=LOAD_RTOL, atol=0.0).all()):
                break
        else:
            return candidate.contiguous()
    raise ValueError(f"{what}: the GGUF tensor's weights are not the float model's in any "
                     f"row order tried; the model cannot be served from its quantized blocks "
                     f"(--dtype float32 runs the float conversion)")


def _refuse_unsupported(types: dict[str, str]) -> None:
    bad = sorted({t for t in types.values() if t not in SUPPORTED})
    if bad:
        names = sorted(n for n, t in types.items() if t in bad)
        raise ValueError(f"--quantization gguf reads the quant types {', '.join(SUPPORTED)} "
                         f"(and float tensors); this file has {', '.join(bad)} "
                         f"({names[0]}{' and others' if len(names) > 1 else ''}); "
                         f"--dtype float32 runs its float conversion")


def load_into(model: Any, gguf_file: Path) -> Summary:
    """Replace ``model``'s decoder linears and LM head by `GGUFLinear` over ``gguf_file``'s
    blocks, in place (the model is the float conversion of that file). ValueError for a quant
    type the kernels do not read (naming the supported ones), or a tensor that does not
    match the model."""
    tensors = _reader(gguf_file)
    _refuse_unsupported(quantized_linears(tensors))
    cfg = model.config
    targets: list[tuple[str, str]] = []
    for i in range(cfg.num_hidden_layers):
        for path, name in LAYER_TENSORS.items():
            targets.append((f"{_layers_path(model)}.{i}.{path}", f"blk.{i}.{name}.weight"))
    head = model.get_output_embeddings()
    head_path = next(n for n, m in model.named_modules() if m is head)
    targets.append((head_path, "output.weight" if "output.weight" in tensors
                    else "token_embd.weight"))
    replaced: dict[str, int] = {}
    kept = 0
    held = 0
    kernel()        # built (or loaded) before the first tensor: a missing compiler says so here
    with torch.no_grad():
        for module_path, name in targets:
            linear = model.get_submodule(module_path)
            if type(linear) is not torch.nn.Linear:
                raise ValueError(f"{module_path} is {type(linear).__name__}, not a linear")
            if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
                raise ValueError(f"--quantization gguf multiplies float32 activations on CPU; "
                                 f"the model was loaded as {linear.weight.dtype} on "
                                 f"{linear.weight.device.type} (--dtype auto or float32)")
            tensor = tensors.get(name)
            if tensor is None:
                raise ValueError(f"{str(gguf_file)!r} has no tensor {name} for {module_path}")
            type_name = tensor.type_name
            if type_name not in SUPPORTED:
                kept += 1
                continue
            qtype = SUPPORTED[type_name]
            if tensor.dims != (linear.in_features, linear.out_features):
                raise ValueError(f"{name} is {tensor.dims[::-1]} in the file; {module_path} "
                                 f"is ({linear.out_features}, {linear.in_features})")
            blocks = torch.from_numpy(np.array(tensor.data).reshape(linear.out_features, -1))
            blocks = _matching(blocks, qtype, linear.in_features, linear.weight,
                               _row_orders(linear.out_features, cfg, name),
                               f"{name} ({module_path})")
            new = GGUFLinear(blocks, qtype, linear.in_features, linear.bias)
            parent_name, _, attr = module_path.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            replaced[type_name] = replaced.get(type_name, 0) + 1
            held += blocks.numel()
    forget_reader()                 # the blocks are copied: the file's map and fields go
    if model.get_output_embeddings() is not head:
        # the float head is gone (the input embedding keeps its float weight): nothing to tie
        model.config.tie_word_embeddings = False
    return Summary(replaced, kept, held)


def _layers_path(model: Any) -> str:
    layers = model.get_decoder().layers
    return next(n for n, m in model.named_modules() if m is layers)


def fuse(owner: torch.nn.Module, names: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable for ``owner``'s GGUF linears ``names`` side by side on the output axis:
    one stacked `GGUFLinear` when they share a quant type (each part becomes a
    `weight_quant.SliceOf` it, so transformers' forward still works), else the parts' outputs
    concatenated."""
    from vconsole.engine.worker.weight_quant import SliceOf

    parts = [getattr(owner, n) for n in names]
    if len({p.qtype for p in parts}) != 1:
        return lambda x: torch.cat([p(x) for p in parts], dim=-1)
    fused = GGUFLinear.concat(parts)
    at = 0
    for name, part in zip(names, parts, strict=True):
        setattr(owner, name, SliceOf(fused, at, at + part.out_features))
        at += part.out_features
    return fused.forward
