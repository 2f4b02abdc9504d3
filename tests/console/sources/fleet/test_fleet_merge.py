"""Merged percentiles are percentiles of the summed bucket counts, over the bounds every engine
has; a window never has negative counts."""

from __future__ import annotations

import math

from vconsole.console.sources.fleet.merge import merge, merged_percentile, percentile, window
from vconsole.console.sources.vllm_metrics import quantile


def hist(bounds, per_bucket):
    counts, run = [], 0
    for n in per_bucket:
        run += n
        counts.append(run)
    return {"bounds": [*bounds, math.inf], "counts": counts, "count": run, "sum": 0.0}


def test_the_merged_percentile_is_the_percentile_of_the_summed_buckets():
    bounds = [0.01, 0.02, 0.04, 0.08, 0.16]
    a = hist(bounds, [90, 5, 3, 1, 1, 0])      # fast engine
    b = hist(bounds, [0, 0, 10, 60, 30, 0])    # slow engine
    summed = [x + y for x, y in zip(a["counts"], b["counts"], strict=True)]
    p99 = merged_percentile(0.99, [a, b])
    assert p99.value == quantile(0.99, [*bounds, math.inf], summed)
    # not the average of the two engines' p99s
    mean = (quantile(0.99, a["bounds"], a["counts"]) + quantile(0.99, b["bounds"], b["counts"])) / 2
    assert p99.value != mean


def test_engines_of_different_bounds_merge_on_the_bounds_they_share():
    a = hist([0.1, 0.25, 0.5, 1.0], [0, 10, 0, 0, 0])     # all in (0.1, 0.25]
    b = hist([0.1, 0.2, 0.4, 1.0], [0, 0, 10, 0, 0])      # all in (0.2, 0.4]
    bounds, counts = merge([a, b])
    assert bounds == [0.1, 1.0, math.inf]
    assert counts == [0, 20, 20]
    p50 = merged_percentile(0.5, [a, b])
    assert p50.bound == (0.1, 1.0)          # known only as the range it falls in


def test_a_percentile_in_the_open_bucket_is_shown_as_a_lower_bound():
    h = hist([0.1, 0.2], [0, 0, 5])
    p = percentile(0.99, h["bounds"], h["counts"])
    assert p.bound == (0.2, None)


def test_a_window_across_a_restart_never_has_negative_counts():
    before = hist([0.1, 0.2], [50, 50, 0])
    after = hist([0.1, 0.2], [2, 1, 0])          # the server restarted: counts start over
    w = window(after, before)
    assert w["counts"] == after["counts"] and min(w["counts"]) >= 0
    later = hist([0.1, 0.2], [4, 3, 1])
    assert window(later, after)["counts"] == [2, 4, 5]
