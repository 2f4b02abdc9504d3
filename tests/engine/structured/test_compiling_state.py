"""The scheduler's side of a compiling request: held beside the queue, counted, shown,
abortable, expired by ``max_holding_seconds``, queued once its grammar is ready."""

from __future__ import annotations

from vconsole.engine.publish.request_rows import RequestRows
from vconsole.engine.request import FinishReason, Request, RequestStatus
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams, StructuredSpec

SPEC = StructuredSpec("regex", "[a-z]+")


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def scheduler(**cfg: object) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(EngineConfig(**cfg), 64, 8, 512, clock=clock), clock  # type: ignore[arg-type]


def request(rid: str, spec: StructuredSpec | None = SPEC) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=4, structured=spec))


def test_held_until_ready_then_queued_and_scheduled() -> None:
    s, _ = scheduler()
    held, free = request("held"), request("free", None)
    s.add_request(held, compiling=True)
    s.add_request(free)
    assert held.status is RequestStatus.COMPILING and s.has_requests()
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["free"]
    s.update_from_output(so, ModelRunnerOutput({"free": 9}))
    stats = s.stats(10, RequestRows())
    assert stats.num_compiling == 1 and stats.num_waiting == 0
    rows = {r.id: r for r in stats.requests}
    assert rows["held"].state == "compiling" and rows["held"].constraint == SPEC.code
    assert (rows["free"].state, rows["free"].constraint) == ("running", 0)
    assert s.grammar_ready("held") and not s.grammar_ready("held")
    assert held.status is RequestStatus.WAITING and s.stats(0).num_compiling == 0
    assert "held" in s.schedule().num_scheduled_tokens


def test_only_compiling_requests_leave_nothing_ready() -> None:
    s, _ = scheduler()
    s.add_request(request("a"), compiling=True)
    assert s.has_requests() and not s.has_ready_requests()
    s.grammar_ready("a")
    assert s.has_ready_requests()


def test_aborted_while_compiling() -> None:
    s, _ = scheduler()
    s.add_request(request("a"), compiling=True)
    s.abort_requests("a")
    out = s.update_from_output(s.schedule(), ModelRunnerOutput())
    assert [(r.request_id, o.finish_reason) for r, o in out] == [("a", "abort")]
    assert not s.grammar_ready("a") and not s.has_requests()


def test_a_compile_longer_than_max_holding_seconds_times_out() -> None:
    s, clock = scheduler(max_holding_seconds=2.0)
    s.add_request(request("slow"), compiling=True)
    clock.t += 1.0
    s.update_from_output(s.schedule(), ModelRunnerOutput())
    assert s.stats(0).num_compiling == 1
    clock.t += 1.5
    out = s.update_from_output(s.schedule(), ModelRunnerOutput())
    assert [o.finish_reason for _, o in out] == [FinishReason.TIMEOUT.value]
    assert not s.grammar_ready("slow")


def test_a_grammar_end_finishes_the_request() -> None:
    s, _ = scheduler()
    for rid in ("done", "bad", "more"):
        s.add_request(request(rid, None))
    so = s.schedule()
    out = s.update_from_output(so, ModelRunnerOutput(
        {"done": 9, "bad": 9, "more": 9},
        structured_ends={"done": None, "bad": "structured output: token 9 refused"}))
    got = {r.request_id: (o.finish_reason, o.error) for r, o in out}
    assert got == {"done": ("stop", None), "bad": ("error", "structured output: token 9 refused"),
                   "more": (None, None)}
