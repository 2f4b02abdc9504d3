"""Scheduler and waiting queue, driven by a fake paged "model".

`PagedEcho` stands in for the model runner: it keeps the runner's own copy of each request from
the scheduler's plain-data output (the real `RequestStates`), writes every fed token id into its
slot of a fake KV cache (slot = block_ids[p // B] * B + p % B) and, when asked to sample, reads
the whole context back through the block table. A wrong block table, a bad prefix hit, a block
reused while still live or a wrong delta in the scheduler's output shows up as a wrong context.
The token it samples is a function of the context, so a request that was preempted and
recomputed must produce the same output as one that never was.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest

from support.scheduling import BLOCK_SIZE as B
from support.scheduling import make_request as req
from support.scheduling import make_scheduler as make_sched
from vconsole.engine.publish.request_rows import RequestRows
from vconsole.engine.request import Request, RequestStatus
from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.engine.worker.request_state import RequestStates, ScheduledSeq
from vconsole.shared.config import EngineConfig
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams


def next_token(context: list[int]) -> int:
    return 1000 + (sum(context) * 7 + len(context)) % 500


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


class PagedEcho:
    def __init__(self, num_blocks: int, block_size: int = B,
                 script: dict[str, list[int]] | None = None) -> None:
        self.B = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.script = script or {}
        self.streams: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.states = RequestStates()
        self.last: list[ScheduledSeq] = []

    def slot(self, block_ids: list[int], p: int) -> int:
        assert p // self.B < len(block_ids), f"position {p} outside the block table"
        return block_ids[p // self.B] * self.B + p % self.B

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        seqs = self.last = self.states.apply(so)
        for seq in seqs:
            for i, tok in enumerate(seq.token_ids):
                self.slots[self.slot(seq.block_ids, seq.start_pos + i)] = tok
        sampled = {}
        for seq in seqs:
            if seq.do_sample:
                end = seq.start_pos + seq.num_tokens
                ctx = [self.slots[self.slot(seq.block_ids, p)] for p in range(end)]
                assert ctx == seq.state.token_ids, f"{seq.req_id}: bad KV"
                rid = seq.req_id
                script = self.script.get(rid)
                sampled[rid] = script.pop(0) if script else next_token(ctx)
        return ModelRunnerOutput(sampled)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def check_step(s: Scheduler, so: SchedulerOutput, model: PagedEcho) -> None:
    """What every step must satisfy, whatever the workload. Called after the model applied the
    output: its copy of each request must be the scheduler's truth."""
    cfg = s.config
    seqs = model.last
    assert so.total_num_scheduled_tokens == sum(q.num_tokens for q in seqs)
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    sent = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
    assert sorted(sent) == sorted(so.num_scheduled_tokens), "each scheduled request sent once"
    assert set(model.states) == {r.request_id for r in s.running}, "runner holds the running"
    pool = s.kv.pool
    for q in seqs:
        r = s.get_request(q.req_id)
        assert r is not None and r.status == RequestStatus.RUNNING
        assert q.num_tokens > 0 and q.start_pos == r.num_computed_tokens
        assert q.state.token_ids == r.all_token_ids
        assert q.block_ids == s.kv.get_block_ids(r.request_id)
        assert q.do_sample == (q.start_pos + q.num_tokens == r.num_tokens)
        for p in range(q.start_pos, q.start_pos + q.num_tokens):
            assert p // B < len(q.block_ids), "a written slot lies outside the block table"
            assert pool.ref_count(q.block_ids[p // B]) == 1, "writing into a shared block"
    pool.check_invariants()


@dataclass
class Stepped:
    """A step's `SchedulerOutput` (its fields read through) with the sequences the model ran."""

    output: SchedulerOutput
    seqs: list[ScheduledSeq]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.output, name)


def step(s: Scheduler, model: PagedEcho) -> tuple[Stepped, list[RequestOutput]]:
    """One engine step. Streams are collected on the model (as a client would see them): a
    request's final output gets ``new_token_ids`` replaced by its whole stream in
    ``model.final``."""
    so = s.schedule()
    model_output = model(so)
    check_step(s, so, model)
    outs = [o for _, o in s.update_from_output(so, model_output)]
    record(model, outs)
    return Stepped(so, model.last), outs


def record(model: PagedEcho, outs: list[RequestOutput]) -> None:
    for o in outs:
        assert o.request_id not in model.final, "output after the final one"
        stream = model.streams.setdefault(o.request_id, [])
        stream.extend(o.new_token_ids)
        assert o.num_output_tokens == len(stream)
        if o.finished:
            model.final[o.request_id] = RequestOutput(**{**vars(o), "new_token_ids": stream})


def run(s: Scheduler, model: PagedEcho, max_steps: int = 2000,
        on_step=None) -> dict[str, RequestOutput]:
    """Step until idle; return every final output seen by ``model`` (see `step`)."""
    for _ in range(max_steps):
        if not s.has_requests():
            break
        so, outs = step(s, model)
        if on_step:
            on_step(so, outs)
    assert not s.has_requests(), "did not finish"
    return model.final


# --- waiting queue ------------------------------------------------------------------------------

def q_req(rid: str, seq: int, priority: int = 0, arrival: float = 0.0,
          preempted: bool = False) -> Request:
    r = Request(rid, [1], SamplingParams(), priority=priority, arrival_time=arrival)
    r.seq_no = seq
    if preempted:
        r.status = RequestStatus.PREEMPTED
    return r


def drain(q: WaitingQueue) -> list[str]:
    out = []
    while q:
        out.append(q.pop().request_id)
    return out


def test_queue_orders_by_policy():
    rs = [q_req("a", 1, priority=2), q_req("b", 2, priority=0), q_req("c", 3, priority=1),
          q_req("d", 4, priority=0)]
    for policy, want in [("fcfs", "abcd"), ("priority", "bdca")]:
        q = WaitingQueue(policy)
        for r in rs:
            q.add(r, 0.0)
        assert [r.request_id for r in q.ordered()] == list(want)
        assert drain(q) == list(want)


def test_queue_hybrid_aging_is_a_static_key():
    # 'old' (priority 3) arrived 20 s before 'new' (priority 0): with 5 s aging it has earned
    # 4 levels and overtakes; with 10 s aging only 2 and stays behind.
    old = q_req("old", 1, priority=3, arrival=100.0)
    new = q_req("new", 2, priority=0, arrival=120.0)
    for aging, want in [(5.0, ["old", "new"]), (10.0, ["new", "old"])]:
        q = WaitingQueue("hybrid", aging)
        q.add(new, 0.0)
        q.add(old, 0.0)
        assert drain(q) == want


def test_preempted_request_goes_to_the_front_of_its_class():
    fresh = q_req("fresh", 1, priority=1)
    urgent = q_req("urgent", 2, priority=0)
    back = q_req("back", 5, priority=1, preempted=True)
    q = WaitingQueue("priority")
    for r in (fresh, urgent, back):
        q.add(r, 0.0)
    assert drain(q) == ["urgent", "back", "fresh"]
    q = WaitingQueue("fcfs")
    for r in (fresh, urgent, back):
        q.add(r, 0.0)
    assert drain(q) == ["back", "fresh", "urgent"]


def test_queue_lazy_removal_policy_rebuild_and_bounded_memory():
    q = WaitingQueue("fcfs")
    rs = [q_req(f"r{i}", i, priority=-i) for i in range(500)]
    for r in rs:
        q.add(r, float(r.seq_no))
    for r in rs[:400]:
        assert q.remove(r.request_id)
    assert not q.remove("r0") and "r0" not in q and "r450" in q
    assert len(q) == 100
    assert len(q._heap) <= 2 * len(q) + 64 and len(q._timeouts) <= 2 * len(q) + 64
    assert q.peek().request_id == "r400"
    q.set_policy("priority", 5.0)
    assert q.peek().request_id == "r499"
    assert [r.request_id for r in q.ordered(3)] == ["r499", "r498", "r497"]


def test_queue_timeouts_pop_only_the_expired_never_started_ones():
    q = WaitingQueue("fcfs")
    for i in range(10):
        q.add(q_req(f"r{i}", i), float(i))
    q.remove("r1")
    q.pop()  # r0 admitted
    q.add(q_req("p", 20, preempted=True), 0.0)
    assert q.pop_expired(None) == []
    assert [r.request_id for r in q.pop_expired(4.0)] == ["r2", "r3"]
    assert [r.request_id for r in q.ordered()] == ["p", "r4", "r5", "r6", "r7", "r8", "r9"]
    assert [r.request_id for r in q.pop_expired(100.0)] == ["r4", "r5", "r6", "r7", "r8", "r9"]
    assert len(q) == 1  # the preempted one never times out


# --- scheduler ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority", "hybrid"])
def test_random_workload_respects_limits_and_every_output_is_right(policy):
    """Small pool, shared prefixes, chunked prefills and preemptions: each step stays within
    budget and seats, every written slot is in the block table, and every request produces
    exactly what it would alone."""
    rng = random.Random(0)
    s = make_sched(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, policy=policy,
                   hybrid_aging_s=0.5)
    model = PagedEcho(16)
    shared = [rng.randint(1, 9) for _ in range(2 * B)]
    want = {}
    for i in range(30):
        prompt = (shared if rng.random() < 0.5 else []) + \
            [rng.randint(1, 9) for _ in range(rng.randint(1, 20))]
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 12), priority=rng.randint(0, 3))
        s.add_request(r)
        want[r.request_id] = expected_output(prompt, r.sampling.max_tokens)

    running_before: set[str] = set()

    def limits(so, outs):
        assert len(so.seqs) <= 4 and s.num_running <= 4
        scheduled = {q.req_id for q in so.seqs}
        if so.preempted_req_ids and policy == "fcfs":  # running ones had to preempt: no admission
            assert scheduled <= running_before
            assert not scheduled & set(so.preempted_req_ids)
        running_before.clear()
        running_before.update(r.request_id for r in s.running)

    final = run(s, model, on_step=limits)
    assert {rid: o.new_token_ids for rid, o in final.items()} == want
    assert all(o.finish_reason == "length" for o in final.values())
    assert s.stats(0).num_preemptions_total > 0, "the workload should preempt"
    assert s.kv_stats().prefix_hits > 0
    assert s.kv_stats().num_used == 0


def test_chunked_prefill_shares_steps_with_decodes():
    s = make_sched(max_num_batched_tokens=16)
    model = PagedEcho(64)
    s.add_request(req("short", 3, max_tokens=10))
    step(s, model)
    s.add_request(req("long", 40, max_tokens=2))
    chunks = []
    for _ in range(3):
        so, outs = step(s, model)
        by_id = {q.req_id: q for q in so.seqs}
        assert by_id["short"].num_tokens == 1 and by_id["short"].do_sample
        long = by_id["long"]
        chunks.append((long.start_pos, long.num_tokens, long.do_sample))
        assert so.num_decode_tokens == 1 and so.num_prefill_tokens == long.num_tokens
        assert ("long" in {o.request_id for o in outs}) == long.do_sample
    assert chunks == [(0, 15, False), (15, 15, False), (30, 10, True)]


def test_prefill_and_decode_token_counts_including_a_resumed_recompute():
    # 4 blocks of 4: a and b fill the pool; when a needs a third block, b (the later arrival)
    # is preempted with 3 outputs; it resumes after a and recomputes everything.
    s = make_sched(num_blocks=4, enable_prefix_caching=False)
    model = PagedEcho(4)
    prompts = {}
    for rid in "ab":
        r = req(rid, 6, max_tokens=6)
        prompts[rid] = list(r.prompt_token_ids)
        s.add_request(r)
    so, _ = step(s, model)
    assert (so.num_prefill_tokens, so.num_decode_tokens) == (12, 0)
    so, _ = step(s, model)
    assert (so.num_prefill_tokens, so.num_decode_tokens) == (0, 2)
    resumed = []

    def watch(so, outs):
        # A resumed request comes back to the runner whole, with the outputs it must recompute.
        for new in so.scheduled_new_reqs:
            if new.req_id == "b" and new.output_token_ids:
                assert new.num_computed_tokens == 0
                resumed.append((so.num_scheduled_tokens["b"], so.num_prefill_tokens,
                                so.num_decode_tokens))

    final = run(s, model, on_step=watch)
    assert final["b"].num_preemptions == 1
    assert resumed == [(9, 8, 1)]  # 6 prompt + 3 outputs recomputed; the last one is new
    assert final["b"].new_token_ids == expected_output(prompts["b"], 6)


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "a")])
def test_preemption_victim_follows_the_policy_and_the_victim_resumes(policy, victim):
    # 6 blocks of 4. a (priority 2) is admitted first; b and c (priority 0) next. Each prompt
    # takes 2 blocks; the first decode past position 7 needs a third one: someone must go.
    s = make_sched(num_blocks=6, max_num_batched_tokens=64, policy=policy)
    model = PagedEcho(6)
    rs = {rid: req(rid, 6, max_tokens=6, priority=p) for rid, p in zip("abcd", (2, 0, 0, 2),
                                                                       strict=True)}
    s.add_request(rs["a"])
    step(s, model)
    s.add_request(rs["b"])
    s.add_request(rs["c"])
    step(s, model)
    s.add_request(rs["d"])  # not started: must stay behind the victim
    first = None

    def watch(so, outs):
        nonlocal first
        if so.preempted_req_ids and first is None:
            first = so.preempted_req_ids[0]
            assert s.get_request(first).status == RequestStatus.PREEMPTED
            order = [r.request_id for r in s.waiting.ordered()]
            assert order.index(first) < order.index("d")
            assert first not in {q.req_id for q in so.seqs}

    final = run(s, model, on_step=watch)
    assert first == victim
    assert final[victim].num_preemptions >= 1
    for rid, r in rs.items():
        assert final[rid].finish_reason == "length"
        assert final[rid].new_token_ids == expected_output(r.prompt_token_ids, 6)


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    # a (least urgent) is first in running order and gets its decode token; then a later
    # request needs a block and a is the victim: its token goes back to the budget, which the
    # prefill of d uses, so the step is still full.
    s = make_sched(num_blocks=11, max_num_batched_tokens=8, policy="priority")
    model = PagedEcho(11)
    s.add_request(req("a", 4, max_tokens=12, priority=5))
    step(s, model)
    for rid, n in [("b", 4), ("c", 6), ("d", 20)]:
        s.add_request(req(rid, n, max_tokens=12))
    for _ in range(10):
        so, _ = step(s, model)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == ["a"]
    assert [(q.req_id, q.num_tokens) for q in so.seqs] == [("b", 1), ("c", 1),
                                                                         ("d", 6)]
    assert so.total_num_scheduled_tokens == 8
    assert run(s, model)["a"].num_preemptions == 1


def test_waiting_request_of_higher_priority_preempts_under_priority_only():
    for policy in ("priority", "fcfs"):
        s = make_sched(num_blocks=6, max_num_batched_tokens=64, policy=policy)
        model = PagedEcho(6)
        s.add_request(req("a", 11, max_tokens=5, priority=5))
        s.add_request(req("b", 11, max_tokens=5, priority=5))
        step(s, model)                                   # 3 blocks each: the pool is full
        s.add_request(req("vip", 3, max_tokens=2, priority=0))
        so, _ = step(s, model)
        ids = [q.req_id for q in so.seqs]
        if policy == "priority":
            assert ids == ["a", "vip"] and so.preempted_req_ids == ["b"]
            assert s.get_request("b").status == RequestStatus.PREEMPTED
        else:
            assert ids == ["a", "b"] and so.preempted_req_ids == []
        final = run(s, model)
        assert final["vip"].finish_reason == "length"


def test_priority_and_fcfs_admission_order():
    for policy, want in [("fcfs", ["p3", "p1", "p2"]), ("priority", ["p1", "p2", "p3"])]:
        s = make_sched(max_num_seqs=1, policy=policy)
        for rid, prio in [("p3", 3), ("p1", 1), ("p2", 2)]:
            s.add_request(req(rid, 4, max_tokens=1, priority=prio))
        order = []
        run(s, PagedEcho(64), on_step=lambda so, outs, order=order: order.extend(
            q.req_id for q in so.seqs))
        assert order == want


def test_hybrid_aging_lets_an_old_low_priority_request_overtake():
    now = time.monotonic()
    s = make_sched(max_num_seqs=1, policy="hybrid", hybrid_aging_s=5.0)
    s.add_request(req("old", 4, max_tokens=1, priority=4, arrival=now - 30.0))  # earned 6
    s.add_request(req("new", 4, max_tokens=1, priority=0, arrival=now))
    s.add_request(req("mid", 4, max_tokens=1, priority=4, arrival=now - 10.0))  # earned 2
    order = []
    run(s, PagedEcho(64), on_step=lambda so, outs: order.extend(
        q.req_id for q in so.seqs))
    assert order == ["old", "new", "mid"]


def test_abort_waiting_and_running_requests():
    s = make_sched(max_num_seqs=1)
    model = PagedEcho(64)
    s.add_request(req("run", 6, max_tokens=50))
    s.add_request(req("wait", 6, max_tokens=50))
    s.add_request(req("other", 6, max_tokens=3))
    step(s, model)
    step(s, model)
    assert s.kv_stats().num_used > 0
    s.abort_requests(["run", "wait", "nope"])
    s.abort_requests("run")  # twice: ignored
    assert s.num_running == 0 and s.num_waiting == 1 and s.has_requests()
    so, outs = step(s, model)
    got = {o.request_id: o for o in outs}
    assert got["run"].finished and got["run"].finish_reason == "abort"
    assert got["wait"].finished and got["wait"].finish_reason == "abort"
    assert got["run"].new_token_ids == [] and got["run"].num_output_tokens == 2
    final = run(s, model)
    assert final["other"].finish_reason == "length"
    assert s.kv_stats().num_used == 0 and not s.has_requests()


def test_abort_between_schedule_and_update_is_reported_once():
    s = make_sched()
    model = PagedEcho(64)
    s.add_request(req("a", 6, max_tokens=5))
    s.add_request(req("b", 6, max_tokens=5))
    so = s.schedule()
    out = model(so)
    s.abort_requests(["a"])
    outs = [o for _, o in s.update_from_output(so, out)]
    record(model, outs)
    a = [o for o in outs if o.request_id == "a"]
    assert len(a) == 1 and a[0].finish_reason == "abort" and a[0].new_token_ids == []
    assert s.get_request("a") is None
    assert run(s, model)["b"].num_output_tokens == 5


def test_waiting_longer_than_max_holding_seconds_times_out():
    clock = Clock()
    s = make_sched(max_num_seqs=1, max_holding_seconds=1.0, clock=clock)
    model = PagedEcho(64)
    s.add_request(req("first", 4, max_tokens=4))
    s.add_request(req("patient", 4, max_tokens=4))
    step(s, model)
    clock.t += 0.9
    _, outs = step(s, model)
    assert all(not o.finished for o in outs)
    clock.t += 0.2
    _, outs = step(s, model)
    got = {o.request_id: o for o in outs}
    assert got["patient"].finished and got["patient"].finish_reason == "timeout"
    assert not got["first"].finished
    assert run(s, model)["first"].finish_reason == "length"


def test_stop_rules():
    s = make_sched(max_model_len=14)
    model = PagedEcho(64, script={
        "eos": [5, 7, 9, 9], "ignore": [5, 7, 9, 9], "stop": [5, 6, 7, 8], "len": [5, 6, 7, 8],
        "mml": [1, 2, 3, 4, 5]})
    s.add_request(req("eos", 4, eos=7))
    s.add_request(req("ignore", 4, eos=7, ignore_eos=True))
    s.add_request(req("stop", 4, stop_token_ids=(6,)))
    s.add_request(req("len", 4, max_tokens=3))
    s.add_request(req("mml", 9, max_tokens=5))
    final = run(s, model)
    assert (final["eos"].new_token_ids, final["eos"].finish_reason) == ([5, 7], "stop")
    assert (final["ignore"].new_token_ids, final["ignore"].finish_reason) == ([5, 7, 9, 9],
                                                                              "length")
    assert (final["stop"].new_token_ids, final["stop"].finish_reason) == ([5, 6], "stop")
    assert (final["len"].new_token_ids, final["len"].finish_reason) == ([5, 6, 7], "length")
    assert final["mml"].finish_reason == "length" and final["mml"].num_output_tokens == 5


def test_impossible_requests_are_rejected_with_a_reason_while_others_run():
    s = make_sched(num_blocks=8, max_model_len=64)
    model = PagedEcho(8)
    ok = req("ok", 6, max_tokens=6)
    s.add_request(ok)
    step(s, model)
    bad = {
        "empty": (req("empty", []), "empty prompt"),
        "long": (req("long", 60, max_tokens=5), "max_model_len"),
        "huge": (req("huge", 40, max_tokens=4), "KV blocks"),
        "sampling": (req("sampling", 4, temperature=-1.0), "temperature"),
        "dup": (req("ok", 4), "duplicate"),
    }
    for rid, (r, why) in bad.items():
        with pytest.raises(ValueError, match=why):
            s.add_request(r)
        if rid != "dup":
            assert r.finish_reason == "error" and why in r.error
    assert s.num_waiting == 0 and s.get_request("ok").status == RequestStatus.RUNNING
    final = run(s, model)
    assert final["ok"].new_token_ids == expected_output(ok.prompt_token_ids, 6)


def test_hot_max_num_seqs_takes_effect_at_the_next_step():
    s = make_sched(max_num_seqs=1)
    model = PagedEcho(64)
    for i in range(5):
        s.add_request(req(f"r{i}", 4, max_tokens=20))
    step(s, model)
    assert s.num_running == 1
    s.update_config(s.config.replace(max_num_seqs=3))
    assert s.num_running == 1
    so, _ = step(s, model)
    assert s.num_running == 3 and len(so.seqs) == 3
    s.update_config(s.config.replace(max_num_seqs=1))
    so, _ = step(s, model)
    assert s.num_running == 3 and s.num_waiting == 2  # no admissions; the running ones drain
    assert s.stats(0).max_num_seqs == 1


def test_hot_policy_change_reorders_the_waiting_queue():
    s = make_sched(max_num_seqs=1)
    model = PagedEcho(64)
    for rid, prio in [("a", 0), ("b", 5), ("c", 1)]:
        s.add_request(req(rid, 4, max_tokens=1, priority=prio))
    s.add_request(req("d", 4, max_tokens=1, priority=0))
    step(s, model)  # a (fcfs)
    s.update_config(s.config.replace(policy="priority"))
    order = []
    run(s, model, on_step=lambda so, outs: order.extend(q.req_id for q in so.seqs))
    assert order == ["d", "c", "b"]


def test_prefix_cache_hit_in_the_scheduler():
    s = make_sched()
    model = PagedEcho(64)
    shared = list(range(1, 3 * B + 1))
    s.add_request(req("a", shared + [50], max_tokens=2))
    run(s, model)
    s.add_request(req("b", shared + [60, 61], max_tokens=2))
    so, _ = step(s, model)
    (q,) = so.seqs
    assert q.start_pos == 3 * B and q.num_tokens == 2
    assert so.num_prefill_tokens == 2
    final = run(s, model)
    assert final["b"].num_cached_tokens == 3 * B
    assert final["b"].new_token_ids == expected_output(shared + [60, 61], 2)

    s.update_config(s.config.replace(enable_prefix_caching=False))
    s.add_request(req("c", shared + [70], max_tokens=2))
    so, _ = step(s, model)
    assert so.seqs[0].start_pos == 0
    assert run(s, model)["c"].num_cached_tokens == 0


def test_stats_rows_running_first_then_waiting_in_queue_order():
    s = make_sched(max_num_seqs=2, policy="priority")
    model = PagedEcho(64)
    for rid, prio in [("a", 1), ("b", 1), ("c", 3), ("d", 2), ("e", 0)]:
        s.add_request(req(rid, 5, max_tokens=10, priority=prio))
    step(s, model)
    rows = RequestRows()
    st = s.stats(10, rows)
    assert [r.id for r in st.requests] == ["e", "a", "b", "d", "c"]
    assert [r.state for r in st.requests] == ["running"] * 2 + ["waiting"] * 3
    assert st.requests[0].num_blocks == 2 and st.requests[0].num_output_tokens == 1
    assert (st.num_running, st.num_waiting, st.policy) == (2, 3, "priority")
    assert not st.requests_truncated
    st = s.stats(3, rows)
    assert [r.id for r in st.requests] == ["e", "a", "b"] and st.requests_truncated


def test_stats_make_no_rows_of_their_own():
    """The request table is the publishing side's (a `RowSource`): asked for rows without one,
    the scheduler says so; for none, it gives its figures."""
    s = make_sched(max_num_seqs=1)
    for rid in "ab":
        s.add_request(req(rid, 5))
    with pytest.raises(ValueError, match="no RowSource"):
        s.stats(10)
    st = s.stats(0)
    assert (st.num_waiting, list(st.requests), st.requests_truncated) == (2, [], True)
    assert s.waiting.listener is None, "nobody listens to the queue of a scheduler unpublished"


def _lines_per_step(num_waiting: int, steps: int = 10) -> tuple[int, int]:
    """Python lines the scheduler runs over ``steps`` steps (schedule + update, the model
    stubbed) with ``num_waiting`` requests queued, counted by a tracer: a deterministic
    measure of work, unlike a clock. Also returns how many were still waiting."""
    s = make_sched(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=256)
    for i in range(num_waiting):
        s.add_request(req(f"r{i}", 8, max_tokens=4))
    model = PagedEcho(512)
    for _ in range(5):  # warm up: the running set fills
        so = s.schedule()
        s.update_from_output(so, model(so))
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    for _ in range(steps):
        sys.settrace(tracer)
        try:
            so = s.schedule()
        finally:
            sys.settrace(None)
        out = model(so)
        sys.settrace(tracer)
        try:
            s.update_from_output(so, out)
        finally:
            sys.settrace(None)
    return count, s.num_waiting


def test_a_step_does_not_scan_the_waiting_queue():
    """The same steps cost the same Python work with 400 or 10,000 requests waiting (a heap
    admission grows with log n, a scan would grow 25-fold)."""
    small, left_small = _lines_per_step(400)
    large, left_large = _lines_per_step(10_000)
    assert left_small > 0 and left_large > 9000   # both queues still fed every admission
    assert large <= 1.3 * small, (small, large)


def test_any_of_several_eos_ids_stops_a_request():
    cfg = EngineConfig(max_num_seqs=4)
    sched = Scheduler(cfg, num_blocks=16, block_size=4, max_model_len=64)
    req = Request("multi-eos", [5, 6, 7], SamplingParams(max_tokens=10), eos_token_id=2,
                  eos_token_ids=(2, 9))
    sched.add_request(req)
    so = sched.schedule()
    results = sched.update_from_output(so, ModelRunnerOutput({"multi-eos": 9}))
    (_, out), = results
    assert out.finished and out.finish_reason == "stop" and req.output_token_ids == [9]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "hybrid"])
def test_update_reads_a_copy_of_the_step_as_the_step_itself(policy):
    """`update_from_output` walks its own record of the latest step; handed any other
    `SchedulerOutput` (here a copy) it reads the step from that output instead. Both ways give
    the same outputs, preemptions and block tables, step after step."""
    rng = random.Random(3)
    twins = [make_sched(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=24, policy=policy)
             for _ in range(2)]
    models = [PagedEcho(16), PagedEcho(16)]
    shared = [rng.randint(1, 9) for _ in range(2 * B)]
    for i in range(24):
        prompt = (shared if rng.random() < 0.5 else []) + \
            [rng.randint(1, 9) for _ in range(rng.randint(1, 14))]
        max_tokens, priority = rng.randint(1, 10), rng.randint(0, 3)
        for s in twins:
            s.add_request(req(f"r{i}", prompt, max_tokens=max_tokens, priority=priority))
    preempted = 0
    for _ in range(500):
        if not twins[0].has_requests():
            break
        outs = []
        for s, model, as_copy in zip(twins, models, (False, True), strict=True):
            so = s.schedule()
            result = s.update_from_output(copy.copy(so) if as_copy else so, model(so))
            # every field but the phases' seconds, which are each twin's own clock readings
            outs.append([{k: v for k, v in vars(o).items() if k != "timings"}
                         for _, o in result])
            preempted += len(so.preempted_req_ids)
        assert outs[0] == outs[1]
        assert [r.request_id for r in twins[0].running] == [r.request_id for r in twins[1].running]
        for r in twins[0].running:
            assert twins[0].kv.get_block_ids(r.request_id) == \
                twins[1].kv.get_block_ids(r.request_id)
    assert not twins[0].has_requests() and not twins[1].has_requests()
    assert preempted > 0, "the workload should preempt"
