"""``--quantization int4``: a float model's linears as 4-bit GGUF blocks, made at load (issue #47).

A float model (a model directory, a float ``.gguf``, ``tiny``) has no quantized blocks to read
as stored; this quantizes each of its float32 linears once, group-wise in groups of 32 weights
along the input axis, into the GGUF block type `INT4_TYPE`, and runs them on the same kernels
as ``--quantization gguf`` (`gguf_linear.GGUFLinear` over ``csrc/gguf_gemm.cpp``: the GEMV
for up to 4 rows, the GEMM for more, the vector path chosen at run time). The blocks are the
``gguf`` package's quantization (the reference quantizer llama.cpp implements: a float GGUF
served with int4 holds the blocks of the same file quantized by it and served with ``gguf``,
tested), and the fused decoder stacks them as it stacks a GGUF file's.

`INT4_TYPE` is Q4_1 (per 32 weights a float16 scale and a float16 minimum, 5.0 bits a weight):
against Q4_0 (one float16 scale, 4.5 bits) its weights' RMS error is 9-20% lower (Gaussian,
Laplace and Student-t(3) weights, small-gqa's: an offset per group spends the 16 levels
between its minimum and maximum, a signed scale over +-max); no trained float model here tells the two
apart in perplexity fairly (docs/benchmarks.md, #47). The LM head stays at 8 bits
(`HEAD_TYPE` Q8_0, as llama.cpp keeps a 4-bit file's output tensor at 6 bits or more): its
rounding goes straight into every logit: on smollm2, Q4_1 linears with a Q4_1 embedding and
head cost +5.8% perplexity, the same linears with a Q8_0 head nothing measurable.
A linear whose input width is not a multiple of 32 stays float.

Refused (ValueError, at load): a model off the CPU or not float32 (the kernels multiply float32
activations on CPU), and a GGUF whose linears are already quantized: its own blocks run as
stored with ``--quantization gguf`` (the default for it), and re-quantizing them would only
add error.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from vconsole.engine.worker import gguf_linear
from vconsole.engine.worker.gguf_linear import SUPPORTED, GGUFLinear, Summary

log = logging.getLogger(__name__)

INT4_TYPE = "Q4_1"
HEAD_TYPE = "Q8_0"
GROUP = 32
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")     # the types the gguf package quantizes


def quantize_blocks(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """``weight`` ((N, K) float, K a multiple of 32) as (N, row bytes) uint8 blocks of
    ``type_name`` (Q4_0, Q4_1 or Q8_0)."""
    import gguf

    if type_name not in QUANTIZED_TYPES:
        raise ValueError(f"int4 quantizes to {', '.join(QUANTIZED_TYPES)}; not {type_name}")
    w = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"{type_name} rows are whole groups of {GROUP}; the weight is "
                         f"{tuple(w.shape)}")
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(w.shape[0], -1))


def quantize_model(model: Any, type_name: str = INT4_TYPE,
                   head_type: str = HEAD_TYPE) -> Summary:
    """Replace ``model``'s float32 ``nn.Linear`` modules (every one, as int8 does; the LM head
    in ``head_type``) by `GGUFLinear` over their weights quantized to ``type_name``, in
    place. ValueError for a model not float32 on CPU, or a kernel that cannot be built."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, linear in targets:
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(f"--quantization int4 runs on CPU float32 weights (the gguf "
                             f"kernels); {name} is {linear.weight.dtype} on "
                             f"{linear.weight.device.type} (--device cpu, --dtype auto or "
                             f"float32)")
    try:
        gguf_linear.kernel()
    except Exception as e:
        raise ValueError(f"--quantization int4 runs on the gguf kernels, which cannot be built "
                         f"here: {e}") from e
    head = model.get_output_embeddings()
    replaced: dict[str, int] = {}
    kept = held = 0
    with torch.no_grad():
        for name, linear in targets:
            if linear.in_features % GROUP:
                kept += 1
                continue
            kind = head_type if linear is head else type_name
            blocks = quantize_blocks(linear.weight, kind)
            new = GGUFLinear(blocks, SUPPORTED[kind], linear.in_features, linear.bias)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            replaced[kind] = replaced.get(kind, 0) + 1
            held += blocks.numel()
    if head is not None and model.get_output_embeddings() is not head:
        # the head has its own blocks now; the input embedding keeps its float weight
        model.config.tie_word_embeddings = False
    summary = Summary(replaced, kept, held, label="int4")
    log.info("weights: %s (%.0f MB of blocks quantized at load, groups of %d)",
             summary.describe(), held / 1e6, GROUP)
    return summary
