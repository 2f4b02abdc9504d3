"""The PromQL the fleet sends Prometheus, without one: the user's selector joins every series'
own matchers, and the fleet's percentile keeps to the bounds every engine has. (Prometheus
parsing and evaluating it: test_fleet_prometheus.py.)"""

from __future__ import annotations

import pytest

from vconsole.console.sources.fleet import promql
from vconsole.console.sources.fleet.prometheus_rows import _pct, hist


@pytest.mark.parametrize("given, inner", [
    (None, ""), ("", ""), ("{}", ""), ('{job="vllm"}', 'job="vllm"'),
    ('job="vllm", zone=~"eu.*"', 'job="vllm", zone=~"eu.*"'),
    ('{ job != "x" , }', 'job != "x"'),
])
def test_a_selector_becomes_the_matchers_added_to_every_series(given, inner):
    assert promql.matchers(given) == inner


@pytest.mark.parametrize("bad", ['{job="x"', "up", '{__name__="up"}', "{=x}"])
def test_a_selector_that_is_not_label_matchers_is_refused(bad):
    with pytest.raises(promql.SelectorError):
        promql.matchers(bad)


def test_every_series_carries_the_selector_and_no_braces_are_left_empty():
    assert promql.series("up", "") == "up"
    assert promql.series("up", 'job="a"') == 'up{job="a"}'
    assert promql.any_of(("vllm:x", "sglang:y"), 'job="a"') == \
        '{__name__=~`vllm:x|sglang:y`, job="a"}'


def test_the_fleet_quantile_sums_by_le_over_the_bounds_every_engine_has():
    q = promql.fleet_quantile(0.99, "ttft_s", "", ["0.1", "1.0", "+Inf"])
    assert q.startswith("histogram_quantile(0.99, sum by (le) (rate(")
    assert r"le=~`0\.1|1\.0|\+Inf`" in q
    assert "le=~" not in promql.fleet_quantile(0.99, "ttft_s", "", None)


def test_a_percentile_in_the_open_bucket_is_shown_as_its_bound():
    h = hist([("0.1", 0.0), ("1.0", 0.0), ("+Inf", 2.0)])
    p = _pct(1.0, 0.99, h)          # Prometheus answers the last finite bound
    assert p.value == 1.0 and p.bound == (1.0, None)
    assert _pct(None, 0.99, h).value is None
