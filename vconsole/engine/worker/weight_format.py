"""Which weights the model runs on: the model's dtype, int8 (`weight_quant`) or a GGUF file's
quantized blocks as stored (`gguf_linear`), decided once at load.

``--quantization`` names it; unset, a ``.gguf`` model (or ``smollm2``) whose linears are stored
quantized, in types the kernels read, runs them as stored (``gguf``) when the engine runs on CPU
with ``--dtype auto`` (a file with another type runs its float conversion, with a warning);
``--dtype float32`` (or any explicit dtype) keeps the float conversion. A defaulted ``gguf``
that cannot run here (no C++ compiler for the kernels) falls back to the float conversion
with a warning; an explicit one is an error, as is ``gguf`` for a model that is not a GGUF.
``int4`` quantizes a float model's linears at load into 4-bit GGUF blocks run on the same
kernels (`int4_weights`); it is refused off CPU and for a GGUF already quantized.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vconsole.engine.worker.gguf_model import SMOLLM2, find_gguf, smollm2_gguf
from vconsole.shared.config import EngineConfig

log = logging.getLogger(__name__)


def source_gguf(model: str) -> Path | None:
    """The GGUF file a ``--model`` value names (None: not a GGUF model)."""
    if model == SMOLLM2:
        return smollm2_gguf()
    try:
        return find_gguf(Path(model).expanduser())
    except ValueError:
        return None


def chosen(config: EngineConfig, device_type: str) -> str | None:
    """The quantization the engine runs: ``config.quantization``, or ``gguf`` by default for
    a quantized GGUF on CPU with dtype auto, or None (the model's dtype)."""
    if config.quantization is not None:
        return config.quantization
    if config.dtype != "auto" or device_type != "cpu":
        return None
    gguf_file = source_gguf(config.model)
    if gguf_file is None:
        return None
    from vconsole.engine.worker import gguf_linear

    try:
        if not gguf_linear.is_quantized(gguf_file):
            return None
        unread = gguf_linear.unsupported_types(gguf_file)
    except Exception as e:   # unreadable here: the loader already read it, so say and go on
        log.warning("could not read %s's tensor types (%s); running its float conversion",
                    gguf_file, e)
        return None
    if unread:
        # not asked for: the float conversion runs, as before gguf was the default
        log.warning("%s has linears of type %s, which the gguf kernels do not read (they read "
                    "%s); running its float32 conversion", gguf_file.name, ", ".join(unread),
                    ", ".join(gguf_linear.SUPPORTED))
        gguf_linear.forget_reader()
        return None
    return "gguf"


def apply(model: Any, config: EngineConfig, device_type: str) -> str | None:
    """Put ``model`` on the weights `chosen` picks, in place; returns what it runs, as the
    start-up line says it (None: the model's dtype). ValueError for a choice that cannot be
    served (gguf off CPU or for a model that is not a GGUF, an unsupported quant type)."""
    method = chosen(config, device_type)
    if method is None:
        return None
    if method == "int8":
        from vconsole.engine.worker import weight_quant

        weight_quant.quantize_model(model, "int8")
        return weight_quant.many_rows_path().describe()
    if method == "int4":
        return _int4(model, config, device_type)
    if method != "gguf":
        raise ValueError(f"unknown quantization {method!r}")
    explicit = config.quantization == "gguf"
    if device_type != "cpu":
        raise ValueError("--quantization gguf runs on CPU only")
    gguf_file = source_gguf(config.model)
    if gguf_file is None:
        raise ValueError(f"--quantization gguf reads a .gguf model's quantized weights; "
                         f"{config.model!r} is not a GGUF model")
    from vconsole.engine.worker import gguf_linear

    if not explicit:
        try:
            gguf_linear.kernel()
        except Exception as e:
            log.warning("the GGUF kernels are unavailable (%s); running the float32 "
                        "conversion of %s instead", e, gguf_file.name)
            gguf_linear.forget_reader()
            return None
    summary = gguf_linear.load_into(model, gguf_file)
    text = summary.describe()
    log.info("weights: %s (%.0f MB of blocks read as stored from %s)", text,
             summary.weight_bytes / 1e6, gguf_file.name)
    return text


def _int4(model: Any, config: EngineConfig, device_type: str) -> str:
    """A float model's linears quantized to 4-bit GGUF blocks (`int4_weights`); refused off
    CPU and for a GGUF already quantized (its own blocks: ``gguf``)."""
    if device_type != "cpu":
        raise ValueError("--quantization int4 runs on CPU only: its blocks run on the gguf "
                         "kernels, CPU code (on CUDA, leave --quantization unset)")
    gguf_file = source_gguf(config.model)
    if gguf_file is not None:
        from vconsole.engine.worker import gguf_linear

        types = gguf_linear.quantized_types(gguf_file)
        gguf_linear.forget_reader()
        if types:
            raise ValueError(f"--quantization int4 quantizes a float model; {gguf_file.name} "
                             f"is already quantized ({', '.join(types)}): run its blocks as "
                             f"stored with --quantization gguf (the default for it on CPU), "
                             f"or its float conversion with --dtype float32")
    from vconsole.engine.worker import int4_weights

    return int4_weights.quantize_model(model).describe()


def bytes_per_weight(model: Any) -> float | None:
    """The bytes a decoder or head weight takes where the model runs GGUF blocks as stored
    (their bytes over their weights: 0.625 for Q4_1); None for any other model."""
    import torch

    from vconsole.engine.worker.gguf_linear import GGUFLinear

    stored = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    if not stored:
        return None
    # the linears a mixed file keeps float count at their element size
    kept = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.in_features * m.out_features for m in [*stored, *kept])
    return (sum(m.blocks.numel() for m in stored)
            + sum(m.weight.numel() * m.weight.element_size() for m in kept)) / weights
