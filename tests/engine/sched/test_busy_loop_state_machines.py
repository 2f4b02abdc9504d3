"""Every cache the busy loop keeps beside the truth equals a recount, whatever the loop went
through.

The scheduler keeps figures it could recompute but must not (per step, or at 10 Hz over 10k
requests): the cached waiting rows of the ``sched`` table (`WaitingRows`, patched from the
queue's removal log between rebuilds), the block pool's counters and per-block states, the KV
manager's fills and prefix hashes, the runner's copy of every request (`_runner_view` on one
side, the real `RequestStates` on the other), the reported-token marks, the latency histograms
and windows (fed through a pending buffer), the cumulative counters. Two hypothesis state
machines drive a real `Scheduler` over a small block pool (preemptions are common) with a fake
clock and a fake paged model (`PagedRunner`: the real `RequestStates`, plus a KV cache of token
ids read back through the block tables before each sample):

- `BusyLoop`: every kind of event the engine loop sees: requests in (some sharing a prefix, some
  impossible, some reusing an id already reported, some a duplicate), steps, a runner that drops
  a sample or raises before or after it read the step, aborts and finishes between steps or
  between `schedule()` and `update_from_output`, hot config changes (max_num_seqs, policy,
  prefix caching, token budget, timeouts, aging, latency window), time passing, snapshots,
  forced row rebuilds.
- `WaitingRowsUnderChurn`: only requests in, steps and ``sched`` snapshots (some right after a
  forced rebuild), so that a request often leaves the queue several times between two snapshots
  (admitted, preempted back, admitted again): the case that once put the cached rows' ids and
  columns out of step.

After every rule the recounts that disturb no cache are compared: the cached rows' columns in
step, the queue and running list against the live requests, pool invariants and ref counts
against the block tables, fill counters and block states against a recount, prefix hashes and
the KV slots against the tokens, the runner's copy against `_runner_view` and the block tables,
streamed tokens and counters against the requests, no telemetry failure swallowed by the guard.
The snapshots (``stats``, ``latency_batch``) do change the caches (a snapshot patches the
cached rows and drains the pending latency samples, folded here as the publisher folds them), so they are rules, taken at random moments
and each checked in full against the model: the waiting rows are the queue's first rows at the
last rebuild minus every request that left the queue since, even if it came back.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from support.scheduling import BLOCK_SIZE as B
from support.scheduling import make_request, make_scheduler
from vconsole.engine.kv.block_pool import hash_block_tokens
from vconsole.engine.latency import QUANTILES, SERIES, LatencyStats
from vconsole.engine.publish.request_rows import RequestRows
from vconsole.engine.request import FinishReason, Request, RequestStatus
from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.engine.worker.request_state import RequestStates, ScheduledSeq
from vconsole.shared.config import POLICIES, EngineConfig
from vconsole.shared.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from vconsole.wire.outputs import RequestOutput

# A failing run shrinks for up to hypothesis's own limit (300 s); the suite's 300 s timeout
# would cut that short and hide the shrunk steps.
pytestmark = pytest.mark.timeout(900)

NUM_BLOCKS = 9            # 36 token slots: two or three requests fill the pool
MAX_MODEL_LEN = 64
PREFIXES = [list(range(500 + 10 * k, 508 + 10 * k)) for k in range(3)]  # two full blocks each
EOS = 1003
WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# (kind, shared prefix or None, tokens of its own, max_tokens, priority, ends on EOS). At most
# 8 + 12 + 14 = 34 tokens: 9 blocks. A refused kind (too long; an id in use) changes nothing.
# The fake model is deterministic, so requests with the same prompt also share output blocks.
REQUEST = st.tuples(st.sampled_from(["new", "new", "new", "reuse", "impossible", "duplicate"]),
                    st.sampled_from([0, 1, 2, None]), st.integers(0, 12), st.integers(4, 14),
                    st.integers(0, 2), st.booleans())
MISHAPS = ["a sample missing", "an abort before the update", "raise before the runner read it",
           "raise after the runner read it"]


def next_token(context: list[int]) -> int:
    """The fake model: a function of the whole context (a recomputed request samples the same)."""
    return 1000 + (sum(context) * 7 + len(context)) % 50


def note(text: str) -> None:
    """A hypothesis event (statistics: ``--hypothesis-show-statistics``); a no-op in plain tests."""
    if currently_in_test_context():
        event(text)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class PagedRunner:
    """The model runner's side: the real `RequestStates`, plus a KV cache of token ids (slot =
    block * B + offset) written for every fed position and read back through the block table
    before sampling."""

    def __init__(self) -> None:
        self.states = RequestStates()
        self.slots: list[int | None] = [None] * (NUM_BLOCKS * B)

    def __call__(self, so: SchedulerOutput) -> tuple[list[ScheduledSeq], ModelRunnerOutput]:
        seqs = self.states.apply(so)
        for seq in seqs:
            table = seq.block_ids
            for i, tok in enumerate(seq.token_ids):
                p = seq.start_pos + i
                assert p // B < len(table), f"{seq.req_id}: position {p} outside its blocks"
                self.slots[table[p // B] * B + p % B] = tok
        sampled = {}
        for seq in seqs:
            if seq.do_sample:
                end = seq.start_pos + seq.num_tokens
                ctx = [self.slots[seq.block_ids[p // B] * B + p % B] for p in range(end)]
                assert ctx == seq.state.token_ids, f"{seq.req_id}: the KV read back is wrong"
                sampled[seq.req_id] = next_token(ctx)
        return seqs, ModelRunnerOutput(sampled)


class LatencyModel:
    """Every latency observation the scheduler should have made, with the time it was made:
    the histograms hold all of them, the windows those not yet pruned."""

    def __init__(self) -> None:
        self.all: dict[str, list[tuple[float, float, int]]] = {n: [] for n in SERIES}
        self.window: dict[str, list[tuple[float, float, int]]] = {n: [] for n in SERIES}

    def observe(self, name: str, value: float, priority: int, now: float) -> None:
        self.all[name].append((now, max(value, 0.0), priority))
        self.window[name].append((now, max(value, 0.0), priority))

    def prune(self, now: float, window_s: float) -> None:
        """Windows keep one-second bins; a bin goes once it lies wholly before the window (and
        stays gone if the window widens later)."""
        for name, obs in self.window.items():
            self.window[name] = [o for o in obs if int(o[0]) + 1 > now - window_s]

    def check(self, snap: dict, window_s: float, finished: Counter) -> None:
        assert snap["window_s"] == window_s
        assert snap["finished"] == dict(finished)
        priorities = {p for obs in self.all.values() for _, _, p in obs}
        assert list(snap["priority"]) == [str(p) for p in sorted(priorities)]
        self._check_group(snap["overall"], None)
        for p in priorities:
            self._check_group(snap["priority"][str(p)], p)

    def _check_group(self, group: dict, priority: int | None) -> None:
        for name, bounds in SERIES.items():
            values = [v for _, v, p in self.all[name] if priority in (None, p)]
            hist = group["histograms"][name]
            per_bucket = Counter(bisect.bisect_left(bounds, v) for v in values)
            assert hist["count"] == len(values), (name, priority)
            assert hist["counts"] == np.cumsum(
                [per_bucket[i] for i in range(len(bounds) + 1)]).tolist(), (name, priority)
            assert math.isclose(hist["sum"], sum(values), rel_tol=1e-9, abs_tol=1e-9)
            recent = [v for _, v, p in self.window[name] if priority in (None, p)]
            win = group["window"][name]
            assert win["count"] == len(recent), (name, priority)
            if not recent:
                assert [win[f"p{q}"] for q in QUANTILES] == [None] * len(QUANTILES)
                continue
            want = np.percentile(recent, QUANTILES).tolist()
            got = [win[f"p{q}"] for q in QUANTILES]
            assert all(map(math.isclose, got, want)), (name, priority, got, want)


class BusyLoopModel(RuleBasedStateMachine):
    """A scheduler, a runner, a model of what each cache must say, and the invariants; requests
    in and steps are the rules of every machine, the others are the subclasses' (each picks
    the events it drives)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.s: Scheduler = make_scheduler(
            NUM_BLOCKS, MAX_MODEL_LEN, self.clock, policy="priority", max_num_seqs=4,
            max_num_batched_tokens=16, latency_window_s=5.0)
        # The request table as the publishing side makes it, its log on the queue from the
        # start. The cached waiting rows are rebuilt only when a rule invalidates them or when
        # they must (too few rows left, more wanted): never on the wall clock.
        self.rows = RequestRows(refresh_s=1e9)
        self.rows.log_of(self.s.waiting)
        self.runner = PagedRunner()
        self.accepted: list[Request] = []      # every request the scheduler took, in order
        self.latest: dict[str, Request] = {}   # id -> the last request accepted under it
        self.streamed: dict[Request, list[int]] = {}
        self.reported: set[Request] = set()    # final output seen
        self.tokens_seen: dict[Request, int] = {}
        self.first_scheduled: dict[Request, float] = {}
        self.first_token: dict[Request, float] = {}
        self.last_token: dict[Request, float] = {}
        self.finished: Counter[str] = Counter()
        self.finish_seen: set[Request] = set()
        self.latency = LatencyModel()
        self.published = LatencyStats()        # the publisher's aggregate of the batches
        self.prefix_queries = self.prefix_hits = 0
        self.next_token_id = 2000              # prompt tails: distinct from everything else
        # The waiting rows as of the last rebuild: (request, its preemptions then), in order.
        self.rows_at_rebuild: list[tuple[Request, int]] = []

    # --- requests in ---------------------------------------------------------------------------
    def live(self) -> list[Request]:
        return [r for r in self.accepted if r.status != RequestStatus.FINISHED]

    def prompt(self, prefix: int | None, tail: int) -> list[int]:
        head = [] if prefix is None else PREFIXES[prefix]
        tail = max(tail, 0 if head else 1)   # a bare prefix: the same prompt as others
        toks = list(range(self.next_token_id, self.next_token_id + tail))
        self.next_token_id += tail
        return head + toks

    def add(self, spec: tuple) -> Request | None:
        kind, prefix, tail, max_tokens, priority, eos = spec
        rid = f"r{len(self.accepted)}"
        if kind == "reuse":   # a finished request's id is free once its final output went out
            taken = {r.request_id for r in self.live()} | set(self.s._finished)
            free = sorted({r.request_id for r in self.reported} - taken)
            rid = free[tail % len(free)] if free else rid
        elif kind in ("impossible", "duplicate"):
            self.refused(kind, tail)
            return None
        r = make_request(rid, self.prompt(prefix, tail), max_tokens, priority,
                         arrival=self.clock.t, eos=EOS if eos else None)
        self.s.add_request(r)
        self.accepted.append(r)
        self.latest[rid] = r
        self.streamed[r] = []
        return r

    def refused(self, kind: str, i: int) -> None:
        """Too long for the model or the pool, or an id in use: refused, nothing else moves."""
        live = self.live()
        if kind == "duplicate" and live:
            r = live[i % len(live)]
            dup = make_request(r.request_id, 4, arrival=self.clock.t)
            with pytest.raises(ValueError, match="duplicate"):
                self.s.add_request(dup)
            assert dup.status == RequestStatus.WAITING and r.status != RequestStatus.FINISHED
            return
        r = make_request("too-big", 40 + i, 10, arrival=self.clock.t)
        with pytest.raises(ValueError, match="exceeds max_model_len|KV blocks"):
            self.s.add_request(r)
        assert r.status == RequestStatus.FINISHED and r.finish_reason == FinishReason.ERROR

    @initialize(batch=st.lists(REQUEST, min_size=3, max_size=8))
    def a_first_load(self, batch):
        for spec in batch:
            self.add(spec)

    # --- steps ---------------------------------------------------------------------------------
    def one_step(self, mishap: str | None = None, i: int = 0) -> SchedulerOutput:
        """One engine step, as `EngineCore.step` runs it, perhaps going wrong (`MISHAPS`)."""
        so = self.s.schedule()
        if so.preempted_req_ids:
            note("a step preempted")
        self.note_scheduled(so)
        if mishap in ("raise before the runner read it", "raise after the runner read it"):
            if mishap == "raise after the runner read it":
                self.runner.states.apply(so)
            self.s.fail_step(so, "the model raised")
            for rid in so.num_scheduled_tokens:
                r = self.s.get_request(rid)
                assert r.finish_reason == FinishReason.ERROR and r.error == "the model raised"
            self.collect(self.s.update_from_output(so, ModelRunnerOutput()))
            return so
        seqs, out = self.runner(so)
        self.check_seqs(seqs)
        missing = None
        if mishap == "a sample missing" and out.sampled:
            missing = sorted(out.sampled)[i % len(out.sampled)]
            del out.sampled[missing]
        if mishap == "an abort before the update" and so.num_scheduled_tokens:
            ids = list(so.num_scheduled_tokens)
            self.s.abort_requests(ids[i % len(ids)])
        self.collect(self.s.update_from_output(so, out))
        if missing is not None:
            r = self.latest[missing]
            assert r.finish_reason == FinishReason.ERROR and "no token" in r.error
        return so

    def note_scheduled(self, so: SchedulerOutput) -> None:
        now, get = self.clock.t, self.s.get_request
        for rid in so.num_scheduled_tokens:
            r = get(rid)
            self.first_scheduled.setdefault(r, now)
            assert r.first_scheduled_time == self.first_scheduled[r]
        for new in so.scheduled_new_reqs:
            r = get(new.req_id)
            if r.num_preemptions == 0 and self.s.kv.enable_prefix_caching:
                self.prefix_queries += r.num_tokens
                self.prefix_hits += new.num_computed_tokens

    def check_seqs(self, seqs: list[ScheduledSeq]) -> None:
        """The runner's copy of each scheduled request is the scheduler's truth."""
        pool = self.s.kv.pool
        for seq in seqs:
            r = self.s.get_request(seq.req_id)
            assert r.status == RequestStatus.RUNNING
            assert seq.start_pos == r.num_computed_tokens and seq.num_tokens > 0
            assert seq.state.token_ids == r.all_token_ids
            assert seq.block_ids == self.s.kv.tables[r.request_id]
            assert seq.do_sample == (seq.start_pos + seq.num_tokens == r.num_tokens)
            for p in range(seq.start_pos, seq.start_pos + seq.num_tokens):
                assert pool.ref_count(seq.block_ids[p // B]) == 1, "writing into a shared block"

    def collect(self, results: list[tuple[Request, RequestOutput]]) -> None:
        """What a client would see: each token streamed once, one final output per request."""
        for r, o in results:
            assert o.request_id == r.request_id and r not in self.reported
            stream = self.streamed[r]
            stream.extend(o.new_token_ids)
            assert o.num_output_tokens == len(stream) == len(r.output_token_ids)
            assert o.finished == (r.status == RequestStatus.FINISHED)
            if o.finished:
                assert o.finish_reason == r.finish_reason.value
                self.reported.add(r)
        self.observe()

    def observe(self) -> None:
        """New tokens and finishes since the last look, at the clock's time (the clock moves
        only in `advance_clock`, so this is the time the scheduler recorded them)."""
        now, lat = self.clock.t, self.latency
        for r in self.accepted:
            seen, n = self.tokens_seen.get(r, 0), len(r.output_token_ids)
            assert n - seen <= 1, "more than one token in one step"
            if n > seen:
                if r in self.first_token:
                    lat.observe("itl_s", now - self.last_token[r], r.priority, now)
                else:
                    self.first_token[r] = now
                    lat.observe("ttft_s", now - r.arrival_time, r.priority, now)
                self.last_token[r] = now
                self.tokens_seen[r] = n
            if r.status == RequestStatus.FINISHED and r not in self.finish_seen:
                self.finish_seen.add(r)
                self.finished[r.finish_reason.value] += 1
                lat.observe("e2e_s", now - r.arrival_time, r.priority, now)
                sched = self.first_scheduled.get(r)
                if sched is not None:
                    lat.observe("queue_s", sched - r.arrival_time, r.priority, now)
                first, last = self.first_token.get(r), self.last_token.get(r)
                if sched is not None and first is not None:
                    lat.observe("prefill_s", first - sched, r.priority, now)
                    lat.observe("decode_s", last - first, r.priority, now)
                    lat.observe("inference_s", last - sched, r.priority, now)

    # --- requests out, config ------------------------------------------------------------------
    def end_request(self, i: int, reason: FinishReason) -> None:
        live = self.live()
        if not live:
            self.s.abort_requests("no-such-request")
            return
        r = live[i % len(live)]
        if reason == FinishReason.ABORT:
            self.s.abort_requests(r.request_id)
            assert r.error is None
        else:
            error = "told to" if reason == FinishReason.ERROR else None
            self.s.finish_requests([r.request_id], reason, error=error)
            assert r.error == error
        assert r.finish_reason == reason
        self.s.abort_requests(["no-such-request", r.request_id])   # finished: ignored
        self.observe()

    def reconfigure(self, **changes: object) -> None:
        s = self.s
        s.update_config(EngineConfig(**{**s.config.to_dict(), **changes}))

    # --- snapshots -----------------------------------------------------------------------------
    def snapshot_sched(self, max_rows: int, rebuild_first: bool = False) -> None:
        """The ``sched`` snapshot: running rows exact and first; then the waiting rows, which
        are the queue's first rows at the last rebuild minus every request that left the queue
        since (even if it came back), in queue order, each exact."""
        s, now = self.s, self.clock.t
        rows, log = self.rows.cached, self.rows.log_of(s.waiting)
        if rebuild_first:
            rows.invalidate()
        rebuilds = rows.rebuilds
        left, _ = log.removed_since(rows._mark)
        twice = any(n > 1 for rid, n in Counter(left or ()).items() if rid in rows._ids)
        stats = s.stats(max_rows, self.rows)
        rows.check(log)
        cols = stats.requests.columns
        n = len(cols["id"])
        assert all(len(v) == n for v in cols.values()), "ids and columns out of step"
        assert len(set(cols["id"])) == n, "a request listed twice"

        running = s.running[:max_rows]
        rest = max(0, max_rows - len(running))
        if rows.rebuilds != rebuilds:
            self.rows_at_rebuild = [(r, r.num_preemptions) for r in s.waiting.ordered(rows._limit)]
            assert rows._limit >= rest
            assert cols["id"][len(running):] == [r.request_id for r in s.waiting.ordered(rest)]
        elif twice and rest and s.waiting:
            note("a cached row's request left the queue twice since the last snapshot")
        still = [r for r, k in self.rows_at_rebuild
                 if s._requests.get(r.request_id) is r and r.status in WAITING_STATES
                 and r.num_preemptions == k]      # waiting all along since the rebuild
        want = running + (still[:rest] if rest and s.waiting else [])
        assert table_of(cols) == [row_of(s, r, now) for r in want]
        assert is_subsequence(cols["id"][len(running):],
                              [r.request_id for r in s.waiting.ordered()])

        live = self.live()
        waiting = [r for r in live if r.status in WAITING_STATES]
        assert (stats.num_waiting, stats.num_running) == (len(waiting), len(s.running))
        assert stats.num_preempted == sum(r.status == RequestStatus.PREEMPTED for r in waiting)
        assert stats.requests_truncated == (len(live) > max_rows)
        assert (stats.policy, stats.max_num_seqs, stats.max_num_batched_tokens) == (
            s.config.policy, s.config.max_num_seqs, s.config.max_num_batched_tokens)
        assert (stats.num_finished_total, stats.num_preemptions_total) == (
            s.num_finished_total, s.num_preemptions_total)
        assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (
            s.num_prompt_tokens_total, s.num_generation_tokens_total)

    def snapshot_latency(self) -> None:
        window_s = self.s.config.latency_window_s
        self.latency.prune(self.clock.t, window_s)
        self.published.add(self.s.latency_batch())
        self.latency.check(self.published.snapshot(self.s.clock()), window_s, self.finished)

    # --- after every rule: the recounts that change no cache -----------------------------------
    # Requests in and steps: the two rules every machine drives; the rest are the subclasses'.
    @rule(batch=st.lists(REQUEST, min_size=1, max_size=5))
    def add_requests(self, batch):
        for spec in batch:
            self.add(spec)

    @rule(times=st.integers(1, 12))
    def step(self, times):
        for _ in range(times):
            self.one_step()

    @invariant()
    def no_telemetry_failure_was_swallowed(self):
        assert self.s.telemetry.errors_total == 0, self.s.telemetry.last_error

    @invariant()
    def the_cached_waiting_rows_are_in_step(self):
        self.rows.cached.check(self.rows.log_of(self.s.waiting))

    @invariant()
    def queue_and_running_hold_exactly_the_live_requests(self):
        s, live = self.s, self.live()
        waiting = [r for r in live if r.status in WAITING_STATES]
        assert {r.request_id for r in live} == set(s._requests)
        assert all(s._requests[r.request_id] is r for r in live)
        assert len(s.waiting) == len(waiting) and all(r.request_id in s.waiting for r in waiting)
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        assert len(s.running) + len(waiting) == len(live)
        assert s._num_preempted_waiting == sum(
            r.status == RequestStatus.PREEMPTED for r in waiting)

    @invariant()
    def the_block_pool_matches_the_block_tables(self):
        s = self.s
        pool, tables = s.kv.pool, s.kv.tables
        pool.check_invariants()
        assert set(tables) == {r.request_id for r in s.running}, "only running requests hold"
        holders = Counter(b for t in tables.values() for b in t)
        for r in s.running:
            table = tables[r.request_id]
            assert len(table) == len(set(table))
            assert len(table) * B >= r.num_computed_tokens, "blocks short of computed tokens"
        for b in range(NUM_BLOCKS):
            assert pool.ref_count(b) == holders[b], f"block {b}"

    @invariant()
    def kv_fill_counters_equal_a_recount(self):
        s = self.s
        pool, tables = s.kv.pool, s.kv.tables
        fill: dict[int, int] = {}
        for r in s.running:
            for i, b in enumerate(tables[r.request_id]):
                fill[b] = max(fill.get(b, 0), min(B, max(0, r.num_computed_tokens - i * B)))
        used = set(fill)
        holders = Counter(b for t in tables.values() for b in t)
        cached = {b for b in range(NUM_BLOCKS)
                  if b not in used and pool.block_hash(b) is not None}
        stored = sum(fill.values())
        kv = s.kv_stats()
        assert (kv.num_blocks, kv.block_size) == (NUM_BLOCKS, B)
        assert kv.num_used == len(used) and kv.num_cached == len(cached)
        assert kv.num_free == NUM_BLOCKS - len(used) - len(cached)
        assert kv.num_shared == sum(c > 1 for c in holders.values())
        assert pool.tokens_stored == stored
        assert kv.usage == len(used) / NUM_BLOCKS
        assert kv.token_usage == stored / (NUM_BLOCKS * B)
        assert kv.fragmentation == (1.0 - stored / (len(used) * B) if used else 0.0)
        assert (kv.prefix_queries, kv.prefix_hits) == (self.prefix_queries, self.prefix_hits)
        states = [BLOCK_SHARED if holders[b] > 1 else BLOCK_USED if b in used
                  else BLOCK_CACHED if b in cached else BLOCK_FREE for b in range(NUM_BLOCKS)]
        assert kv.block_states.tolist() == states

    @invariant()
    def blocks_hold_the_tokens_they_are_found_by(self):
        """A block findable in the prefix cache is full and holds exactly the prefix its hash
        names; every written KV slot of a running request holds its token."""
        s = self.s
        pool, slots = s.kv.pool, self.runner.slots
        for r in s.running:
            table, toks = s.kv.tables[r.request_id], r.all_token_ids
            chain = hash_chain(toks, r.num_computed_tokens // B)
            for i, b in enumerate(table):
                h = pool.block_hash(b)
                if h is not None:
                    assert (i + 1) * B <= r.num_computed_tokens and h == chain[i]
            for p in range(r.num_computed_tokens):
                assert slots[table[p // B] * B + p % B] == toks[p], (r.request_id, p)

    @invariant()
    def the_runner_holds_what_the_scheduler_thinks_it_holds(self):
        s = self.s
        view, held = s._runner_view, self.runner.states
        assert set(view) == {r.request_id for r in s.running}
        assert set(view) <= set(held), "the runner lost a request"
        assert set(held) - set(view) <= s._finished_req_ids, "the runner was not told to forget"
        for rid, (num_tokens, num_blocks) in view.items():
            state, r = held[rid], s._requests[rid]
            assert (len(state.token_ids), len(state.block_ids)) == (num_tokens, num_blocks)
            assert state.token_ids == r.all_token_ids[:num_tokens]
            assert state.block_ids == s.kv.tables[rid]
            assert r.num_tokens - num_tokens in (0, 1)

    @invariant()
    def streams_and_counters_equal_a_recount(self):
        s = self.s
        for r in self.accepted:
            assert self.streamed[r] == r.output_token_ids
            unreported = s._finished.get(r.request_id) is r
            assert (r.status == RequestStatus.FINISHED) == (r in self.reported or unreported)
            if r.status != RequestStatus.FINISHED or unreported:
                assert s._num_reported[r.request_id] == len(r.output_token_ids)
        assert s.num_finished_total == sum(self.finished.values()) == sum(
            r.status == RequestStatus.FINISHED for r in self.accepted)
        assert s.num_preemptions_total == sum(r.num_preemptions for r in self.accepted)
        assert s.num_generation_tokens_total == sum(len(r.output_token_ids)
                                                    for r in self.accepted)
        assert s.num_prompt_tokens_total == sum(r.num_prompt_tokens for r in self.accepted
                                                if r.output_token_ids)

    def teardown(self):
        note(f"preemptions in the run: {'some' if self.s.num_preemptions_total else 'none'}")

    def check_all(self) -> None:
        """Every invariant, for the plain tests below (hypothesis runs them after each rule)."""
        checks = [f for f in vars(BusyLoopModel).values()
                  if getattr(f, "hypothesis_stateful_invariant", None) is not None]
        assert len(checks) >= 8
        for check in checks:
            check(self)


class BusyLoop(BusyLoopModel):
    """Every event of the engine loop (see the module docstring)."""

    @rule(mishap=st.sampled_from(MISHAPS), i=st.integers(0, 100))
    def a_step_that_goes_wrong(self, mishap, i):
        """A runner that returns no token for a request, an abort between `schedule()` and
        `update_from_output`, a model that raises (`fail_step`) before or after the runner
        took in the step's changes."""
        self.one_step(mishap, i)

    @rule(i=st.integers(0, 100), reason=st.sampled_from(
        [FinishReason.ABORT, FinishReason.ABORT, FinishReason.LENGTH, FinishReason.STOP,
         FinishReason.ERROR]))
    def end_a_request(self, i, reason):
        """Abort (or finish with another reason) a live request; unknown ids are ignored."""
        self.end_request(i, reason)

    @rule(max_num_seqs=st.integers(2, 6), policy=st.sampled_from(POLICIES),
          prefix_caching=st.booleans(), budget=st.sampled_from([4, 7, 16, 64]),
          holding=st.sampled_from([None, None, 2.0, 10.0]), aging=st.sampled_from([0.5, 5.0]),
          window=st.sampled_from([1.0, 5.0, 60.0]))
    def change_the_config(self, max_num_seqs, policy, prefix_caching, budget, holding, aging,
                          window):
        self.reconfigure(max_num_seqs=max_num_seqs, policy=policy,
                         enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget,
                         max_holding_seconds=holding, hybrid_aging_s=aging,
                         latency_window_s=window)

    @rule(dt=st.sampled_from([0.05, 0.3, 1.0, 2.5, 7.0]))
    def advance_clock(self, dt):
        self.clock.t += dt

    @rule()
    def force_a_row_rebuild(self):
        self.rows.cached.invalidate()

    @rule(max_rows=st.integers(0, 16), rebuild_first=st.booleans())
    def take_a_sched_snapshot(self, max_rows, rebuild_first):
        self.snapshot_sched(max_rows, rebuild_first)

    @rule()
    def take_a_latency_snapshot(self):
        self.snapshot_latency()


class WaitingRowsUnderChurn(BusyLoopModel):
    """Requests in, steps and ``sched`` snapshots only: requests leave and re-enter the waiting
    queue many times between two snapshots (see the module docstring)."""

    @rule(max_rows=st.integers(0, 16), rebuild_first=st.booleans())
    def take_a_sched_snapshot(self, max_rows, rebuild_first):
        self.snapshot_sched(max_rows, rebuild_first)


def row_of(s: Scheduler, r: Request, now: float) -> tuple:
    return (r.request_id, int(r.status), r.priority, r.num_prompt_tokens,
            len(r.output_token_ids), len(s.kv.tables.get(r.request_id, ())),
            max(now - r.arrival_time, 0.0))


def table_of(cols: dict) -> list[tuple]:
    return list(zip(cols["id"], *(cols[c].tolist() for c in (
        "state", "priority", "num_prompt_tokens", "num_output_tokens", "num_blocks", "age_s")),
        strict=True))


def hash_chain(tokens: list[int], num_blocks: int) -> list[int]:
    out: list[int] = []
    for i in range(num_blocks):
        out.append(hash_block_tokens(out[-1] if out else None, tokens[i * B:(i + 1) * B]))
    return out


def is_subsequence(xs: list[str], ys: list[str]) -> bool:
    it = iter(ys)
    return all(x in it for x in xs)


# No explain phase: its tracer (Python < 3.12) makes each replay of a failing run many times
# slower, and the shrunk steps already say what happened.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
BusyLoop.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                      database=None, phases=PHASES)
WaitingRowsUnderChurn.TestCase.settings = settings(max_examples=120, stateful_step_count=40,
                                                   deadline=None, database=None, phases=PHASES)
TestBusyLoop = BusyLoop.TestCase
TestWaitingRowsUnderChurn = WaitingRowsUnderChurn.TestCase


# --- the same parts, one fixed story each ------------------------------------------------------

def test_a_full_pool_preempts_and_every_cache_still_equals_its_recount():
    m = BusyLoop()
    m.a_first_load([("new", p, 12, 14, prio, False) for p, prio in [(0, 2), (1, 1), (2, 0)]])
    m.check_all()
    for _ in range(30):
        m.one_step()
        m.check_all()
        m.snapshot_sched(16)
    m.snapshot_latency()
    assert m.s.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in m.accepted) == m.s.num_preemptions_total


def test_a_request_admitted_preempted_and_admitted_again_between_snapshots_loses_its_row():
    """The demo's crash, through the scheduler: ``a`` is in the cached rows, is admitted,
    preempted by the more urgent ``b``, admitted again, all before the next snapshot: its id is
    twice in the queue's removal log, and its one row goes once."""
    m = WaitingRowsUnderChurn()
    m.reconfigure(max_num_seqs=2, max_num_batched_tokens=64)
    a = m.add(("new", 0, 12, 8, 1, False))           # 20 tokens: 5 of the 9 blocks
    c = m.add(("new", 1, 12, 4, 2, False))           # 5 blocks: never fits beside a
    m.snapshot_sched(10, rebuild_first=True)
    assert [r.request_id for r, _ in m.rows_at_rebuild] == [a.request_id, c.request_id]
    m.one_step()                                     # a admitted (its first token)
    m.one_step()                                     # a decodes into a sixth block
    b = m.add(("new", None, 16, 2, 0, False))        # 4 blocks: only if a makes way
    so = m.one_step()
    assert so.preempted_req_ids == [a.request_id] and b.status == RequestStatus.RUNNING
    m.end_request(m.live().index(b), FinishReason.ABORT)
    m.one_step()                                     # a admitted again
    assert a.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    left, _ = m.rows.log_of(m.s.waiting).removed_since(m.rows.cached._mark)
    assert left.count(a.request_id) == 2
    m.check_all()
    m.snapshot_sched(10)
    assert [r.id for r in m.s.stats(10, m.rows).requests] == [a.request_id, c.request_id]
