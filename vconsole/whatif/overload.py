"""Overload told apart: a config that serves fewer requests per second than arrive.

Under overload the waiting queue grows for as long as requests keep arriving, so a TTFT figure
is the backlog at the trace's end: it grows with the trace's length, and a small error in the
step cost becomes a large one in it (a 5% capacity error gave 15-18% on TTFT, #44). Such a
figure is not a property of the config, so the report says "overloaded" first and gives the
capacity instead.

- **Capacity** (`capacity`): the variant run on the trace's own requests all waiting at once,
  through the same scheduler and step-time model; requests finished per second while the
  queue was not empty, and output tokens per second then. The request mix (prompt and output
  lengths, shared prefixes) is the trace's.
- **Arrival rate** (`arrival_rate`): the trace's requests over the span of their arrivals,
  every one that arrived: under overload clients abort and time out, and leaving those out
  would hide the overload they are a sign of.
- **Verdict**: overloaded when the arrival rate exceeds the capacity by more than the
  capacity's own error (``margin``: the step-time model's error at the shapes the config runs,
  `vconsole.whatif.intervals.shape_error`) over at least `MIN_SPAN_S` of arrivals; **near
  capacity** when the arrival rate is within that error of the capacity, either side (steps
  that cost 1 ± e times the model's put the real load at load × (1 ± e): near when
  1 / (1 + e) <= load <= 1 / (1 - e)): the model cannot tell whether the queue grows, so it
  says so instead of choosing. (Written after a held-out run on `tiny` where a pool predicted
  4% above its arrivals, with a 6% step-time error, was said to keep up and its queue grew:
  not yet validated on a trace it was not written on.)
  Arrivals that come faster over a shorter span are a ``burst`` (its queue drains once it
  has passed: its waits are figures of the burst, not unbounded).
- **Queue growth** (`queue_growth`), measured on finished requests, predicted or real: the
  median wait to the first token of the last quarter of arrivals less that of the first
  quarter, over the time between them: 0.2 means each second of arrivals added 0.2 s of wait.
  The bench judges a real replay's queue as growing with it (`grows`).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

from vconsole.telemetry.request_trace import RequestRecord, Trace, finished_normally
from vconsole.whatif.simulate import SimResult

# The figures that are waits in the queue: under overload they grow with the trace's length
# (`GROWS` stands in their place), near capacity their interval is open-ended (`MAY_GROW`).
QUEUE_FIGURES = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s")
GROWS = "grows"
MAY_GROW = "grows?"

CAPACITY_REQUESTS = 400  # a saturated run of more measures the same rate, slower
MIN_SPAN_S = 5.0         # arrivals faster than the capacity for less than this: a burst
GROWTH_LIMIT = 0.05      # s of added wait per s of arrivals: a queue that grows
GROWTH_FACTOR = 2.0      # and the last quarter waits at least this many times the first


def arrival_rate(requests: list[RequestRecord]) -> float | None:
    """Requests per second over the span of their arrivals (None under two requests)."""
    times = sorted(r.arrival for r in requests)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def saturated(trace: Trace, most: int = CAPACITY_REQUESTS) -> Trace:
    """``trace`` with every request arriving at once (at its first arrival); at most
    ``most`` of them, every k-th, so the mix stays the trace's and a long trace's capacity
    costs no more to measure than a short one's."""
    out = copy.copy(trace)
    t0 = min((r.arrival for r in trace.requests), default=0.0)
    step = max(1, -(-len(trace.requests) // most))
    out.requests = [copy.copy(r) for r in trace.requests[::step]]
    for r in out.requests:
        r.arrival = t0
    return out


def capacity(result: SimResult) -> dict[str, float | None]:
    """Requests and output tokens per second of a saturated run (`saturated`), counted up to
    the moment the queue first ran empty (the drain after it runs part-empty batches)."""
    if not result.requests:
        return {"req_s": None, "output_tok_s": None}
    t0 = min(r.arrival for r in result.requests)
    end = next((s.t for s in result.steps if s.waiting == 0), None)
    done = [r for r in result.requests if end is None or r.finish <= end]
    if end is None or len(done) < max(5, len(result.requests) // 2):
        done = result.requests                  # too few before the queue emptied: all
        end = max(r.finish for r in done)
    span = end - t0
    if span <= 0:
        return {"req_s": None, "output_tok_s": None}
    return {"req_s": round(len(done) / span, 3),
            "output_tok_s": round(sum(r.output_len for r in done) / span, 1)}


def queue_growth(requests: list[RequestRecord]) -> dict[str, float | bool | None]:
    """How fast the wait to the first token grows across the trace (see the module
    docstring): ``rate`` (s per s of arrivals), ``first`` / ``last`` (the quarters' median
    waits) and ``grows``."""
    done = sorted((r for r in requests if finished_normally(r) and r.first_token is not None),
                  key=lambda r: r.arrival)
    q = len(done) // 4
    if q < 3:
        return {"rate": None, "first": None, "last": None, "grows": False}
    head, tail = done[:q], done[-q:]
    first = statistics.median(r.first_token - r.arrival for r in head)    # type: ignore[operator]
    last = statistics.median(r.first_token - r.arrival for r in tail)     # type: ignore[operator]
    dt = statistics.median(r.arrival for r in tail) - statistics.median(r.arrival for r in head)
    rate = (last - first) / dt if dt > 0 else None
    grows = rate is not None and rate > GROWTH_LIMIT and last > GROWTH_FACTOR * first
    return {"rate": None if rate is None else round(rate, 4), "first": round(first, 6),
            "last": round(last, 6), "grows": grows}


def verdict(trace: Trace, run_saturated: Callable[[Trace], SimResult],
            result: SimResult, margin: float = 0.0) -> dict[str, Any]:
    """The overload verdict of one config: ``overloaded``, ``near_capacity``, ``burst``,
    ``arrival_req_s``, ``capacity`` (`capacity` of ``run_saturated(saturated(trace))``),
    ``load`` (arrivals over capacity), ``margin`` (the capacity's relative error) and the
    predicted ``queue_growth`` of ``result`` (its run on the trace's own arrivals)."""
    arrived = trace.requests            # aborted and timed-out ones too (module docstring)
    rate = arrival_rate(arrived)
    cap = capacity(run_saturated(saturated(trace)))
    load = rate / cap["req_s"] if rate is not None and cap["req_s"] else None
    span = (max(r.arrival for r in arrived) - min(r.arrival for r in arrived)
            if arrived else 0.0)
    sustained = span >= MIN_SPAN_S
    # Steps that cost (1 ± margin) times the model's give a real load of load × (1 ± margin):
    # over 1 for sure beyond 1 / (1 - margin), under it for sure below 1 / (1 + margin).
    high = 1 / (1 - margin) if margin < 1 else float("inf")
    low = 1 / (1 + margin)
    return {"overloaded": load is not None and load > high and sustained,
            "near_capacity": load is not None and low <= load <= high and sustained,
            "burst": load is not None and load > 1 and not sustained,
            "arrival_req_s": None if rate is None else round(rate, 3),
            "arrival_span_s": round(span, 3), "capacity": cap,
            "load": None if load is None else round(load, 3), "margin": round(margin, 4),
            "queue_growth": queue_growth(result.requests)}


def wait_mark(key: str, v: dict[str, Any] | None) -> str:
    """For a wait (`QUEUE_FIGURES`) under verdict ``v``: `GROWS` when overloaded (it stands
    for the figure), `MAY_GROW` near capacity (it stands for the interval), else ""."""
    if key not in QUEUE_FIGURES or not v:
        return ""
    return GROWS if v.get("overloaded") else MAY_GROW if v.get("near_capacity") else ""


def overload_line(name: str, v: dict[str, Any]) -> str:
    """``overloaded: max_num_seqs=6 serves 14.2 req/s (2,310 output tok/s), 16.8 arrive: the
    queue grows without bound at this rate, so its TTFT grows with the trace's length``."""
    cap = v["capacity"]
    tok = cap.get("output_tok_s")
    tok_part = f" ({tok:,.0f} output tok/s)" if tok is not None else ""
    return (f"overloaded: {name} serves {cap['req_s']:,.1f} req/s{tok_part}, "
            f"{v['arrival_req_s']:,.1f} arrive: the queue grows without bound at this rate, "
            f"so its TTFT grows with the trace's length")


def near_line(name: str, v: dict[str, Any]) -> str:
    """``near capacity: num_kv_blocks=96 serves 14.3 req/s ±6.1%, 13.7 arrive: within the
    model's error of what arrives, the queue may grow; its waits are uncertain``."""
    cap = v["capacity"]
    return (f"near capacity: {name} serves {cap['req_s']:,.1f} req/s "
            f"±{100 * v.get('margin', 0.0):.1f}%, {v['arrival_req_s']:,.1f} arrive: within the "
            f"model's error of what arrives, the queue may grow; its waits are uncertain")


def verdict_line(name: str, v: dict[str, Any] | None) -> str:
    """`overload_line` or `near_line` for a verdict that says either, else ""."""
    if not v:
        return ""
    if v.get("overloaded"):
        return overload_line(name, v)
    if v.get("near_capacity"):
        return near_line(name, v)
    return ""
