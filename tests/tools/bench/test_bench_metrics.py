"""`vconsole bench metrics`' reading of the engine's exposition (the bench itself runs engines
and a Prometheus for minutes: the lead runs it, docs/prometheus.md)."""

from __future__ import annotations

from vconsole.tools.bench.metrics_scrape import family_sum

EXPOSITION = """# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4000.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 6000.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 4000.0
vllm:generation_tokens_total 12.0
vllm:generation_tokens_created 1.7e9
"""


def test_a_family_is_summed_over_its_label_sets_and_no_longer_name_is_counted() -> None:
    assert family_sum(EXPOSITION, "vllm:num_requests_waiting") == 10_000
    assert family_sum(EXPOSITION, "vllm:generation_tokens_total") == 12
    assert family_sum(EXPOSITION, "vllm:num_requests_running") == 0
