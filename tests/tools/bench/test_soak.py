"""`vconsole bench soak`: the demo's workload against a real supervised engine process for 30
seconds through the real client (the crash this guards against came at 18–80 s; the stateful
tests in tests/engine/sched/test_busy_loop_state_machines.py find its cause in under a second, and
`vconsole bench soak --minutes 10` is the long run). Passing means no restart, no request error, no telemetry
error, preemptions seen and every output token the engine counted received by the client —
the run that found the demo's crash (a row cache on the busy loop) would fail it."""

from __future__ import annotations

import pytest

from vconsole.tools.bench.soak import soak_bench


@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.long           # make test-long; `vconsole bench soak` is the soak itself
def test_a_30_second_soak_of_the_demo_workload_passes():
    out = soak_bench(0.5)
    assert out["checks"] == {
        "no_restarts": True, "no_request_errors": True, "no_telemetry_errors": True,
        "engine_idle_at_end": True, "tokens_equal_counters": True, "preemptions_seen": True,
    }, out
    assert out["passed"] and out["tokens_received"] == out["tokens_engine"] > 0
    assert out["completed"] > 20 and out["rss_warm_bytes"] > 0 and out["rss_end_bytes"] > 0
