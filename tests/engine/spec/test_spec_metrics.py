"""vLLM's spec-decode counters from the engine's own scheduler to ``/metrics`` (the collector
over the ``sched`` payload, as a scrape reads it), and the console's figures of them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vconsole.console import spec_view
from vconsole.engine.offline import make_core
from vconsole.engine.publish.bodies import sched_body
from vconsole.engine.publish.prometheus import TelemetryCollector
from vconsole.wire.sampling import SamplingParams

SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}')


class _Bodies:
    def __init__(self, bodies):
        self.bodies = bodies

    def last_bodies(self):
        return dict(self.bodies)


def _scrape(sched: dict) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(_Bodies({"sched": sched}), model_name="tiny", engine=0))
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


@pytest.mark.slow
def test_the_engines_counters_reach_metrics_under_vllms_names():
    core = make_core(model="tiny", device="cpu", dtype="float32", num_kv_blocks=64,
                     speculative_config=SPEC)
    ids = list(range(10, 22))
    req = core.make_request("a", prompt_token_ids=ids * 3,
                            sampling=SamplingParams(max_tokens=6, temperature=0.0,
                                                    ignore_eos=True))
    core.add_request(req)
    core.step()
    req.spec_token_ids = [7, 8, 9]          # a draft the model will not follow (all rejected)
    core.step()
    s = core.scheduler
    assert (s.spec_num_drafts, s.spec_num_draft_tokens) == (1, 3)
    stats = core.scheduler_stats(0)
    spec = stats.spec_decode
    assert spec is not None and spec["enabled"] and spec["num_speculative_tokens"] == 3
    got = _scrape(sched_body(stats, max_rows=0))
    assert got[("vllm:spec_decode_num_drafts_total", ())] == s.spec_num_drafts
    assert got[("vllm:spec_decode_num_draft_tokens_total", ())] == s.spec_num_draft_tokens
    assert got[("vllm:spec_decode_num_accepted_tokens_total", ())] == \
        s.spec_num_accepted_tokens
    assert [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 (("position", str(i)),))] for i in range(3)] == s.spec_accepted_per_pos
    # without speculation configured: no spec-decode series at all (as vLLM)
    plain = make_core(model="tiny", device="cpu", dtype="float32", num_kv_blocks=64)
    assert plain.scheduler_stats(0).spec_decode is None
    assert not any(name.startswith("vllm:spec_decode")
                   for name, _ in _scrape(sched_body(plain.scheduler_stats(0), max_rows=0)))


def test_the_console_shows_acceptance_and_tokens_per_step():
    sc = {"spec_decode": {"enabled": True, "num_speculative_tokens": 4, "num_drafts": 10,
                          "num_draft_tokens": 40, "num_accepted_tokens": 30,
                          "accepted_per_pos": [9, 8, 7, 6], "requests": {"r1": [4, 16, 12]}}}
    line = spec_view.summary(sc)
    assert line is not None and "75%" in line and "4.00" in line and "on" in line
    assert "paused" in (spec_view.summary({"spec_decode": {**sc["spec_decode"],
                                                           "enabled": False}}) or "")
    assert spec_view.of_request(sc, "r1") == "spec 12/16 accepted (75%) · 4.00 tok/step"
    assert spec_view.of_request(sc, "r2") is None
    assert spec_view.summary({}) is None and spec_view.summary(None) is None
