"""The CPU a benchmark ran on, as its report names it: the model name and the vector extensions
that decide which kernels run (AVX2, AVX-512 and its VNNI / BF16 parts, AMX, AVX-VNNI)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# /proc/cpuinfo flag -> the name people use, in the order they came.
VECTOR_FLAGS = {
    "avx": "AVX", "f16c": "F16C", "fma": "FMA", "avx2": "AVX2", "avx_vnni": "AVX-VNNI",
    "avx512f": "AVX-512F", "avx512bw": "AVX-512BW", "avx512vl": "AVX-512VL",
    "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16", "avx512_fp16": "AVX-512 FP16",
    "amx_tile": "AMX-TILE", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16",
}


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def cpu_description() -> dict[str, Any]:
    """``{"model", "cores", "vector_extensions"}`` of this machine."""
    model, flags = _cpuinfo()
    return {"model": model, "cores": os.cpu_count(),
            "vector_extensions": [name for flag, name in VECTOR_FLAGS.items() if flag in flags]}
