"""The KV map's age bands and the residency lines, on plain arrays and wire histograms."""

from __future__ import annotations

import math

import numpy as np

from vconsole.console.widgets.kv_grid import age_bands, age_counts
from vconsole.console.widgets.kv_residency import OFF, residency_lines, sparkline
from vconsole.engine.publish.block_residency import ResidencyHistograms

NAN = math.nan


def test_a_cell_takes_the_band_of_its_youngest_block_that_is_not_free() -> None:
    states = np.array([1, 2, 0, 0, 3, 0, 1, 0], np.uint8)
    ages = np.array([0.5, 700, 0.1, NAN, 30, 5, NAN, NAN], np.float32)
    # one block per cell: free -> 0; <1s -> 1, <10s -> 2, <1m -> 3, <10m -> 4, older/never -> 5
    assert age_bands(states, ages, 1).tolist() == [1, 5, 0, 0, 3, 0, 5, 0]
    # two per cell: the youngest busy block decides; a free one's age does not count
    assert age_bands(states, ages, 2).tolist() == [1, 0, 3, 5]
    assert age_bands(states, ages, 3).tolist() == [1, 3, 5]     # the last cell is padded
    assert age_counts(states, ages) == [1, 0, 1, 0, 2]


def test_the_lines_show_each_distributions_count_and_the_off_hint() -> None:
    h = ResidencyHistograms()
    h.add([(2.0, 0.5, (0.01, 0.02)), (20.0, 15.0, ())])
    lines = residency_lines(h.body(), 80)
    assert lines[0].startswith("[b]block residency")
    assert lines[1].split()[:2] == ["lifetime", "2"]
    assert lines[3].split()[:3] == ["reuse", "gap", "2"]
    assert residency_lines(None, 80) == [f"[$text-muted]{OFF}[/]"]


def test_the_sparkline_has_one_bar_per_bucket_scaled_to_the_fullest() -> None:
    assert sparkline([0, 4, 4, 6]) == " █ ▄"
    assert sparkline([0, 0]) == ""
