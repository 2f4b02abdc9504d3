"""This machine's CPU peaks, measured once: what the MFU estimate is a share of.

The peaks are measured, not read from a datasheet (as `vconsole bench throughput`'s FLOP
utilisation): the best of a few float32 matrix products (numpy's BLAS, every core it uses) and
the best of a few copies of a 32 MiB array (bytes read + written per second). Rough by nature —
a loaded machine measures low — and taken once, on the publisher's side (its thread or
process) when ``enable_mfu_metrics`` is on and the engine runs on the CPU, so the busy loop never
waits for it. A GPU engine gets none: its peak is the device's, which numpy cannot measure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

MATMUL_N = 2048              # smaller products measure the call, not the cores
COPY_BYTES = 32 << 20
REPEATS = 3


@dataclass(frozen=True)
class Peaks:
    flops_per_s: float
    bytes_per_s: float


def measure_peaks(repeats: int = REPEATS) -> Peaks:
    """About half a second on a 2-core machine (~100 GFLOP/s, ~10 GB/s there)."""
    n = MATMUL_N
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = a.T.copy()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / max(time.perf_counter() - t, 1e-9))
    src = np.ones(COPY_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    bw = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        bw = max(bw, 2 * COPY_BYTES / max(time.perf_counter() - t, 1e-9))
    return Peaks(best, bw)
