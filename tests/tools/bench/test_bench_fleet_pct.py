"""The fleet bench's percentiles are nearest-rank: p99 of 100 refreshes is the 99th, not the
slowest."""

from __future__ import annotations

from vconsole.tools.bench.fleet import _pct


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]          # 1 .. 100, shuffled order is fine
    assert _pct(values[::-1], 0.99) == 99.0
    assert _pct(values, 0.5) == 50.0
    assert _pct(values, 1.0) == 100.0
    assert _pct(values, 0.0) == 1.0
    assert _pct([3.0], 0.99) == 3.0
    assert _pct([1.0, 2.0], 0.5) == 1.0
    assert _pct([], 0.5) is None
