"""Overload told apart: a config that serves fewer requests per second than arrive is said to
be overloaded first, with its capacity, and its waits read "grows" instead of a figure that
only measures how long the trace happened to be; a config that keeps up is never called
overloaded. The traces are `make_trace`'s (steps of a known cost: ~10 ms + 2 ms per row)."""

from __future__ import annotations

import pytest
from test_simulate import make_trace  # the simulator's hand-built trace

from vconsole.commands.whatif import format_report
from vconsole.telemetry.request_trace import RequestRecord
from vconsole.whatif.overload import arrival_rate, queue_growth, saturated
from vconsole.whatif.predict import whatif


def records(waits: list[float], gap: float = 0.1) -> list[RequestRecord]:
    return [RequestRecord(arrival=i * gap, first_token=i * gap + w, finish=i * gap + w + 0.5,
                          prompt_len=32, output_len=8, max_tokens=8, itl_us=[1000] * 7)
            for i, w in enumerate(waits)]


def test_a_wait_that_grows_with_every_arrival_is_a_growing_queue():
    growing = queue_growth(records([0.05 + 0.3 * i * 0.1 for i in range(100)]))
    assert growing["grows"] and growing["rate"] == pytest.approx(0.3, rel=0.05)
    steady = queue_growth(records([0.05 + 0.02 * (i % 5) for i in range(100)]))
    assert not steady["grows"]
    assert not queue_growth(records([0.1] * 8))["grows"]          # too few to judge
    assert arrival_rate(records([0.1] * 11)) == pytest.approx(10.0)


def test_capacity_is_measured_on_the_trace_s_mix_all_waiting_at_once():
    trace = make_trace(200, rate=20.0)
    few = saturated(trace, most=50)
    assert len(few.requests) == 50 and {r.arrival for r in few.requests} == {
        trace.requests[0].arrival}
    assert [r.output_len for r in few.requests] == [r.output_len
                                                    for r in trace.requests[::4]]
    assert len(trace.requests) == 200 and trace.requests[1].arrival > trace.requests[0].arrival


@pytest.fixture(scope="module")
def heavy():
    """200 requests at 20/s (10 s of them) against one seat and two: neither keeps up."""
    return whatif(make_trace(200, rate=20.0), [{"max_num_seqs": 1}, {"max_num_seqs": 2}])


@pytest.fixture(scope="module")
def light():
    """60 requests at 0.5/s: any of these configs keeps up."""
    return whatif(make_trace(rate=0.5), [{"max_num_seqs": 2}], intervals=False)


def test_a_variant_serving_fewer_requests_than_arrive_is_overloaded_with_its_capacity(heavy):
    for v in heavy["variants"]:
        over = v["overload"]
        assert over["overloaded"]
        assert over["capacity"]["req_s"] < over["arrival_req_s"]
        assert over["queue_growth"]["grows"]      # the simulated queue grows too
    one, two = (v["overload"]["capacity"]["req_s"] for v in heavy["variants"])
    assert one < two                                # fewer seats, less capacity


def test_a_variant_that_keeps_up_is_never_called_overloaded(light):
    for entry in (light["baseline"], *light["variants"]):
        assert not entry["overload"]["overloaded"]
        assert entry["overload"]["capacity"]["req_s"] > entry["overload"]["arrival_req_s"]
    assert "overloaded" not in format_report(light)


def test_a_short_burst_is_not_called_overloaded():
    burst = whatif(make_trace(30, rate=200.0), [{"max_num_seqs": 1}], intervals=False)
    over = burst["variants"][0]["overload"]
    assert over["burst"] and not over["overloaded"]
    assert over["arrival_req_s"] > over["capacity"]["req_s"]
    assert "overloaded" not in format_report(burst)


def test_overload_is_said_first_and_its_waits_read_grows(heavy, light):
    text = format_report(heavy)
    lines = text.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("output tok/s"))
    said = [i for i, line in enumerate(lines) if line.startswith("overloaded: max_num_seqs=1")]
    assert said and said[0] < first_table
    cap = heavy["variants"][0]["overload"]["capacity"]["req_s"]
    assert f"serves {cap:,.1f} req/s" in text
    assert "the queue grows without bound at this rate" in text
    ttft = next(line for line in lines if line.startswith("TTFT p50"))
    assert "grows" in ttft
    assert ttft.split("grows", 1)[1].strip() in ("", "!")   # no change, no interval beside it
    tok = next(line for line in lines if line.startswith("output tok/s"))
    assert tok.count("±") == 2                      # beside predicted now and the variant
    calm = next(line for line in format_report(light).splitlines()
                if line.startswith("TTFT p50"))
    assert "grows" not in calm


def test_aborted_requests_count_as_arrivals_so_they_cannot_hide_an_overload():
    """Under overload clients give up: a trace whose every other request was aborted still
    had all of them arrive, and its arrival rate says so."""
    trace = make_trace(200, rate=20.0)
    for r in trace.requests[1::2]:
        r.finish_reason, r.output_len, r.first_token, r.itl_us = "abort", 0, None, []
    over = whatif(trace, [{"max_num_seqs": 1}], intervals=False)["variants"][0]["overload"]
    assert over["arrival_req_s"] == pytest.approx(arrival_rate(trace.requests), abs=0.001)
    assert over["arrival_span_s"] == pytest.approx(
        trace.requests[-1].arrival - trace.requests[0].arrival, abs=0.001)
    assert over["overloaded"]


def test_arrivals_within_the_model_s_error_of_the_capacity_are_near_capacity_not_a_verdict(
        heavy):
    """Where what arrives is within the step-time model's error of the capacity, the model
    cannot tell whether the queue grows: it says "near capacity" with that error instead of
    either verdict; beyond it, the verdict stands. The capacity does not depend on the rate
    (all of the trace's requests at once), and make_trace's arrival times scale as 1/rate."""
    cap = heavy["variants"][0]["overload"]["capacity"]["req_s"]
    unit = arrival_rate(make_trace(200, rate=1.0).requests)
    near = whatif(make_trace(200, rate=cap / unit), [{"max_num_seqs": 1}], intervals=False)
    v = near["variants"][0]["overload"]
    assert v["load"] == pytest.approx(1.0, abs=0.01) and v["margin"] > 0
    assert v["near_capacity"] and not v["overloaded"] and not v["burst"]
    text = format_report(near)
    assert "near capacity: max_num_seqs=1 serves" in text and "the queue may grow" in text
    assert "overloaded" not in text
    waits = [ln for ln in text.splitlines() if ln.startswith(("TTFT", "E2E", "e2e"))]
    assert waits and all("grows?" in ln for ln in waits)    # no interval bounds a wait here
    m = v["margin"]
    assert 1 / (1 + m) <= v["load"] <= 1 / (1 - m)
    beyond = 1 + 2 * m                  # past 1 / (1 - m) above, below 1 / (1 + m) under
    for rate, over in ((cap * beyond / unit, True), (cap / beyond / unit, False)):
        w = whatif(make_trace(200, rate=rate), [{"max_num_seqs": 1}],
                   intervals=False)["variants"][0]["overload"]
        assert w["overloaded"] is over and not w["near_capacity"]
