"""The three KV block residency histograms of ``--kv-cache-metrics``, on the publisher's side.

The engine samples evictions (`vconsole.engine.kv.residency`) and hands the samples over about
once a second; they are folded here into cumulative histograms with vLLM's bounds, which the
``step`` topic carries (``kv_residency``) and ``/metrics`` serves as
``vllm:kv_block_lifetime_seconds``, ``vllm:kv_block_idle_before_evict_seconds`` and
``vllm:kv_block_reuse_gap_seconds``. Publisher thread only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vconsole.engine.latency import Histogram
from vconsole.shared.stats import RESIDENCY_BUCKETS
from vconsole.shared.stats import ResidencySample as Sample


class ResidencyHistograms:
    def __init__(self) -> None:
        self.lifetime = Histogram(RESIDENCY_BUCKETS)
        self.idle = Histogram(RESIDENCY_BUCKETS)
        self.reuse_gap = Histogram(RESIDENCY_BUCKETS)

    def add(self, samples: Iterable[Sample]) -> None:
        for lifetime, idle, gaps in samples:
            self.lifetime.observe(lifetime)
            self.idle.observe(idle)
            for gap in gaps:
                self.reuse_gap.observe(gap)

    def body(self) -> dict[str, Any]:
        """The ``step`` topic's ``kv_residency`` field: wire histograms (as ``latency``'s)."""
        return {"lifetime_s": self.lifetime.to_dict(), "idle_before_evict_s": self.idle.to_dict(),
                "reuse_gap_s": self.reuse_gap.to_dict()}
