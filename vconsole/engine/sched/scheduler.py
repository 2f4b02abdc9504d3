"""Continuous batching over the paged KV cache, in the manner of vLLM v1.

One rule covers prefill, chunked prefill, decode and recompute after preemption: a request's
``num_computed_tokens`` catches up with its ``num_tokens``. Each `schedule()` hands every running
request, then as many waiting ones as fit, a share of the step's token budget; when a request's
chunk reaches its last token, the model samples the next one.

Each step:
  1. Waiting requests that never ran and have waited longer than ``max_holding_seconds`` finish
     with ``timeout``.
  2. Running requests, in admission order, get ``min(remaining, budget)`` tokens. When the pool
     has no room, the worst running request by the policy (`WaitingQueue.rank`) is preempted by
     recompute: blocks freed, ``num_computed_tokens`` reset to 0, back to the front of its class
     in the waiting queue. If the worst is the request itself, running requests stop here.
  3. Unless step 2 preempted, waiting requests are admitted in queue order (prefix cache first)
     while seats, budget and blocks allow; under ``priority``/``hybrid`` one with a strictly more
     urgent class key than the worst running request may preempt it. Admission stops at the
     first request that does not fit, so the order is honoured. Lowering ``max_num_seqs`` below
     the number running stops admissions; the running requests drain, none is preempted.

Per-step cost is O(running + admitted * log waiting), never O(waiting).

A request with a structured-output spec is added ``compiling`` (`add_request(...,
compiling=True)`): it waits beside the queue, not in it, until the engine core says its grammar
is ready (`grammar_ready`), and is then queued like any other (its place by arrival). While it
compiles it counts as a request (`has_requests`), can be aborted, expires by
``max_holding_seconds`` as a waiting request does, and shows in the request rows (state
``compiling``) and ``num_compiling``; nothing waits for it.

Call `update_from_output` after every `schedule()` (with an empty `ModelRunnerOutput` when
nothing ran): it is also where requests finished by abort or timeout are reported, and those
of a step whose model execution raised (`fail_step`: that step's requests finish with
``error``, everyone else keeps running).

The runner never sees a `Request`: `_build_output` turns the step into plain data
(`vconsole.engine.sched.output`), sending a request whole the first time and only what changed
after that. ``_runner_view`` is the scheduler's record of what the runner holds per request
(tokens, blocks); a request leaves it when it is preempted or finishes, and the runner is told to
forget it in the same breath.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from vconsole.engine.kv.kv_cache_manager import KVCacheManager, token_slice
from vconsole.engine.latency import LatencyBatch, LatencyLog
from vconsole.engine.request import FinishReason, Request, RequestStatus, request_timings
from vconsole.engine.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vconsole.engine.sched.request_queue import WaitingQueue
from vconsole.engine.telemetry_guard import TelemetryGuard
from vconsole.shared.config import KEY_PER_CHANNEL_KV, EngineConfig, canonical_kv_cache_dtype
from vconsole.shared.speculative import parse_speculative_config
from vconsole.shared.stats import KVStats, RequestTable, SchedulerStats
from vconsole.wire.outputs import RequestOutput


class RowSource(Protocol):
    """Where `Scheduler.stats` gets its request rows: the publishing side, which keeps the
    table's caches and a log of the queue (`vconsole.engine.publish.request_rows.RequestRows`);
    the scheduler keeps none."""

    def table(self, head: list[Request], tables: dict[str, list[int]], queue: WaitingQueue,
              max_waiting: int, now: float) -> RequestTable:
        """``head`` (running, then compiling requests; ``tables`` their block tables) as rows,
        then up to ``max_waiting`` rows of ``queue``'s waiting requests in its order."""


class _Step:
    """What one `schedule()` has decided so far: token budget left, chunks, preemptions."""

    __slots__ = ("now", "budget", "scheduled", "preempted", "drafts")

    def __init__(self, now: float, budget: int) -> None:
        self.now = now
        self.budget = budget
        self.scheduled: dict[str, tuple[Request, int, int]] = {}  # id -> (req, start, n)
        self.preempted: list[str] = []
        self.drafts: dict[str, list[int]] = {}    # id -> draft fed after its last token

    def add(self, req: Request, start: int, n: int) -> None:
        self.scheduled[req.request_id] = (req, start, n)
        self.budget -= n

    def unschedule(self, req: Request) -> None:
        self.preempted.append(req.request_id)
        self.drafts.pop(req.request_id, None)
        done = self.scheduled.pop(req.request_id, None)
        if done is not None:
            self.budget += done[2]


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int,
                 max_model_len: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.clock = clock
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        if canonical_kv_cache_dtype(config.kv_cache_dtype) in KEY_PER_CHANNEL_KV:
            self.kv.lend_staging_blocks()   # here, so the what-if's scheduler lends them too
        self.waiting = WaitingQueue(config.policy, config.hybrid_aging_s)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}       # waiting, running or compiling
        self.compiling: dict[str, Request] = {}       # grammar compiling: not in the queue yet
        self._compiling_since: dict[str, float] = {}  # when each began to, on our clock
        self._finished: dict[str, Request] = {}       # finished, not yet reported
        self._num_reported: dict[str, int] = {}       # output tokens already sent
        self._runner_view: dict[str, tuple[int, int]] = {}  # id -> (tokens, blocks) it holds
        # The latest `schedule()`'s output and its (request, start, tokens), in order, until
        # `update_from_output` reads them.
        self._last_output: SchedulerOutput | None = None
        self._last_scheduled: list[tuple[Request, int, int]] = []
        self.latency = LatencyLog()
        # Every telemetry call on the busy loop goes through it (`vconsole.engine.telemetry_guard`)
        self.telemetry = TelemetryGuard(rebuild=self.rebuild_telemetry)
        self._finished_req_ids: set[str] = set()      # for the runner to forget, next step
        self._seq = 0
        self._num_preempted_waiting = 0
        self.num_preemptions_total = 0
        self.num_finished_total = 0
        self.num_prompt_tokens_total = 0      # see update_from_output
        self.num_generation_tokens_total = 0
        # Speculative decoding: the parsed config (None: off) and vLLM's spec-decode counters
        # (`vllm/v1/spec_decode/metrics.py`): steps that ran a draft, drafted tokens, accepted
        # ones, and accepted ones by position in the draft.
        self.spec = parse_speculative_config(config.speculative_config)
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (self.spec.num_speculative_tokens
                                            if self.spec is not None else 0)

    # --- requests in and out ------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id) or self._finished.get(request_id)

    def has_requests(self) -> bool:
        return bool(self._requests or self._finished)

    def has_ready_requests(self) -> bool:
        """Anything a step can do now: requests to run or finished ones to report (compiling
        requests alone are not: they wait for their grammar)."""
        return len(self._requests) > len(self.compiling) or bool(self._finished)

    def _reject_reason(self, req: Request) -> str | None:
        if req.request_id in self._requests or req.request_id in self._finished:
            return f"duplicate request id {req.request_id!r}"
        if not req.prompt_token_ids:
            return "empty prompt"
        try:
            req.sampling.validate()
        except ValueError as e:
            return str(e)
        total = req.num_prompt_tokens + req.sampling.max_tokens
        if total > self.max_model_len:
            return (f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                    f"({req.sampling.max_tokens}) = {total} exceeds max_model_len "
                    f"{self.max_model_len}")
        # The last sampled token is never fed back, so it needs no slot.
        blocks = self.kv.blocks_needed(total - 1)
        if blocks > self.kv.num_blocks:
            return (f"needs {blocks} KV blocks but the pool has only {self.kv.num_blocks} "
                    f"(block_size {self.block_size})")
        return None

    def add_request(self, req: Request, *, compiling: bool = False) -> None:
        """Queue a request, or raise ValueError(reason) if it can never run. A rejected request
        is marked finished with ``error`` (and is not queued); the others are unaffected.
        ``compiling``: hold it aside until `grammar_ready` (see the module docstring)."""
        reason = self._reject_reason(req)
        if reason is not None:
            if not reason.startswith("duplicate"):
                req.status, req.finish_reason, req.error = (
                    RequestStatus.FINISHED, FinishReason.ERROR, reason)
            raise ValueError(reason)
        self._seq += 1
        req.seq_no = self._seq
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self._num_reported[req.request_id] = len(req.output_token_ids)
        if compiling:
            req.status = RequestStatus.COMPILING
            self.compiling[req.request_id] = req
            self._compiling_since[req.request_id] = self.clock()
            return
        self.waiting.add(req, self.clock())

    def grammar_ready(self, request_id: str) -> bool:
        """A compiling request's grammar is ready: queue it. False when it is no longer
        compiling (aborted or expired meanwhile)."""
        req = self.compiling.pop(request_id, None)
        if req is None:
            return False
        del self._compiling_since[request_id]
        req.status = RequestStatus.WAITING
        self.waiting.add(req, self.clock())
        return True

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Finish waiting or running requests with ``abort``; unknown or finished ids are
        ignored. Reported by the next `update_from_output`."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason, *,
                        error: str | None = None) -> None:
        """Finish waiting or running requests with ``reason`` (and ``error``, the reason a
        person reads); unknown or finished ids are ignored. Reported by the next
        `update_from_output`; the runner forgets them through ``finished_req_ids``, as it
        forgets any finished request."""
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.COMPILING:
                del self.compiling[rid], self._compiling_since[rid]
            else:
                self._leave_waiting(req)
            if error is not None:
                req.error = error
            self._finish(req, reason)

    def fail_step(self, so: SchedulerOutput, error: str) -> None:
        """The runner raised on ``so``: every request it scheduled finishes with ``error``;
        the others (waiting, or running but not in this step) are untouched.

        The runner may have raised before it read ``so``, so the ids ``so`` told it to forget
        are sent again with the next step (forgetting is idempotent, and applied before
        anything new). Call `update_from_output` with an empty `ModelRunnerOutput` afterwards,
        as after any step: it reports these requests."""
        self._finished_req_ids.update(so.finished_req_ids, so.preempted_req_ids)
        self.finish_requests(list(so.num_scheduled_tokens), FinishReason.ERROR, error=error)

    def _leave_waiting(self, req: Request) -> None:
        self.waiting.remove(req.request_id)
        if req.status == RequestStatus.PREEMPTED:
            self._num_preempted_waiting -= 1

    def _finish(self, req: Request, reason: FinishReason, *, report_later: bool = True) -> None:
        """Take a request out of the scheduler (already out of ``running``/``waiting``)."""
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._record_finish(req, reason)
        del self._requests[req.request_id]
        if self._runner_view.pop(req.request_id, None) is not None:
            self._finished_req_ids.add(req.request_id)
        self.num_finished_total += 1
        if report_later:
            self._finished[req.request_id] = req

    # --- config -------------------------------------------------------------------------------
    def update_config(self, config: EngineConfig) -> None:
        """Adopt new hot settings; they take effect from the next `schedule()`, except prefix
        caching switched off, which forgets the cached blocks at once (called between two
        steps), so the KV telemetry and the KV event stream say so while the engine idles."""
        self.config = config
        self.kv.set_prefix_caching(config.enable_prefix_caching)

    def _apply_config(self) -> None:
        cfg = self.config
        self.waiting.set_policy(cfg.policy, cfg.hybrid_aging_s)
        self.kv.set_prefix_caching(cfg.enable_prefix_caching)

    # --- scheduling ---------------------------------------------------------------------------
    def _worst_running(self) -> Request | None:
        rank = self.waiting.rank
        return max(self.running, key=rank, default=None)

    def schedule(self) -> SchedulerOutput:
        self._apply_config()
        cfg = self.config
        step = _Step(self.clock(), cfg.max_num_batched_tokens)
        self._expire(step.now)

        allocate, running_status = self.kv.allocate_slots, RequestStatus.RUNNING
        tables, B = self.kv.tables, self.block_size
        speculate = self.spec is not None and cfg.speculative_decoding
        drafts: list[tuple[Request, list[int]]] = []     # decode rows with a draft, for later
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.status is not running_status:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            n = min(len(req.prompt_token_ids) + len(req.output_token_ids) - computed,
                    step.budget)
            if n <= 0:
                continue
            if req.spec_token_ids:
                draft, req.spec_token_ids = req.spec_token_ids, []
                if speculate and n == 1:
                    drafts.append((req, draft))
            table = tables.get(req.request_id)
            # A table covers len(table) * B positions: most decode steps need no new block.
            if table is None or len(table) * B < computed + n:
                while not allocate(req, n):
                    victim = self._worst_running()
                    assert victim is not None
                    self._preempt(victim, step)
                    if victim is req:
                        break
                if req.status is not running_status:
                    break
            step.scheduled[req.request_id] = (req, req.num_computed_tokens, n)
            step.budget -= n

        if not step.preempted:
            self._admit(cfg, step)
            # Drafts last, from what every running row and admission left: a guess never
            # takes another row's token or block, nor a new request's prefill, and none is
            # made in a step that had to preempt (the pool is short).
            for req, draft in drafts:
                if step.budget <= 0:
                    break
                if req.status is running_status and req.request_id in step.scheduled:
                    self._schedule_draft(req, draft, step)
        return self._build_output(step)

    def _schedule_draft(self, req: Request, draft: list[int], step: _Step) -> bool:
        """Grow a scheduled decode row (one token) by its draft: 1 + len(draft) tokens, the
        draft cut so that every token it could emit stays within max_tokens, max_model_len and
        the budget left. False (the row stays a plain decode) when no draft token fits or the
        pool's free blocks do not hold them (a draft never preempts)."""
        num_tokens = req.num_tokens
        room = min(len(draft), step.budget,
                   req.sampling.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - num_tokens - 1)
        if room <= 0 or not self.kv.allocate_slots(req, 1 + room):
            return False
        step.scheduled[req.request_id] = (req, req.num_computed_tokens, 1 + room)
        step.budget -= room
        step.drafts[req.request_id] = draft[:room]
        return True

    def _admit(self, cfg: EngineConfig, step: _Step) -> None:
        can_preempt = cfg.policy in ("priority", "hybrid")
        kv, waiting = self.kv, self.waiting
        while step.budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting.peek()
            if req is None:
                break
            # A request that wants its prompt's logprobs computes every position (vLLM v1
            # skips reading the cache for it too); its blocks are still cached for others.
            cached_blocks, num_cached = (([], 0) if req.needs_prompt_logprobs
                                         else kv.get_computed_blocks(req))
            n = min(req.num_tokens - num_cached, step.budget)
            fits = kv.allocate_slots(req, n, cached_blocks)
            if not fits and can_preempt and self._can_make_room(req, n, cached_blocks):
                while not fits:
                    victim = self._worst_running()
                    if victim is None or not waiting.class_key(req) < waiting.class_key(victim):
                        break
                    self._preempt(victim, step)  # strictly less urgent: queued behind ``req``
                    fits = kv.allocate_slots(req, n, cached_blocks)
            if not fits:
                break
            waiting.pop()
            if req.status == RequestStatus.PREEMPTED:
                self._num_preempted_waiting -= 1
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = step.now
            self.running.append(req)
            step.add(req, num_cached, n)

    def _can_make_room(self, req: Request, n: int, cached_blocks: list[int]) -> bool:
        """Whether preempting every less urgent running request could free enough blocks, so a
        waiting request never preempts others in vain. O(running); blocks shared with others
        may not come free, so this is an upper bound."""
        key = self.waiting.class_key
        mine = key(req)
        room = self.kv.num_free_blocks + sum(
            self.kv.num_blocks_of(r.request_id) for r in self.running if key(r) > mine)
        return room >= self.kv.num_free_blocks_needed(req, n, cached_blocks)

    def _preempt(self, req: Request, step: _Step) -> None:
        """Preempt by recompute; a request already given tokens this step gives them back."""
        step.unschedule(req)
        self.running.remove(req)
        self.kv.free(req)
        self._runner_view.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._num_preempted_waiting += 1
        self.waiting.add(req, step.now)

    def _expire(self, now: float) -> None:
        limit = self.config.max_holding_seconds
        deadline = None if limit is None else now - limit
        for req in self.waiting.pop_expired(deadline):
            self._finish(req, FinishReason.TIMEOUT)
        if deadline is not None and self.compiling:
            since = self._compiling_since
            for rid in [r for r, t in since.items() if t < deadline]:
                req = self.compiling.pop(rid)
                del since[rid]
                self._finish(req, FinishReason.TIMEOUT)

    def _build_output(self, step: _Step) -> SchedulerOutput:
        out = SchedulerOutput(preempted_req_ids=step.preempted,
                              finished_req_ids=self._finished_req_ids,
                              scheduled_spec_decode_tokens=step.drafts,
                              propose_drafts=self.spec is not None
                              and self.config.speculative_decoding)
        self._finished_req_ids = set()
        view, cached = self._runner_view, out.scheduled_cached_reqs
        tables = self.kv.tables
        c_ids, c_tokens = cached.req_ids.append, cached.new_token_ids.append
        c_blocks, c_computed = cached.new_block_ids.append, cached.num_computed_tokens.append
        num_scheduled = out.num_scheduled_tokens
        num_prefill_total = num_decode_total = context_total = prefill_attention = 0
        prefill_rows = prefill_context = 0
        scheduled = list(step.scheduled.values())
        for req, start, n in scheduled:
            rid = req.request_id
            context_total += start + n
            if n > 1:
                prefill_attention += n * (start + n)   # a draft row's attention FLOPs too
                if rid not in step.drafts:      # but a draft row is a decode row, not a chunk
                    prefill_rows += 1
                    prefill_context += start + n
            num_prompt = len(req.prompt_token_ids)
            outputs = req.output_token_ids
            num_tokens = num_prompt + len(outputs)
            table = tables[rid]
            held = view.get(rid)
            if held is None:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, req.prompt_token_ids, list(outputs), req.sampling, list(table), start))
            else:
                num_held_tokens, num_held_blocks = held
                c_ids(rid)
                c_tokens(outputs[num_held_tokens - num_prompt:] if num_held_tokens >= num_prompt
                         else token_slice(req, num_held_tokens, num_tokens))
                c_blocks(table[num_held_blocks:])
                c_computed(start)
            view[rid] = (num_tokens, len(table))
            num_scheduled[rid] = n
            # Recompute of a resumed request's outputs counts as prefill; only the position
            # that produces the next token after the prompt's is a decode.
            if start + 1 >= num_tokens and start >= num_prompt:
                num_decode_total += n          # the decode step: all of it is decode
                continue
            prefill_end = max(num_prompt, num_tokens - 1)
            num_prefill = max(0, min(start + n, prefill_end) - start)
            num_prefill_total += num_prefill
            num_decode_total += n - num_prefill
        out.num_prefill_tokens = num_prefill_total
        out.num_decode_tokens = num_decode_total
        out.num_context_tokens = context_total
        out.prefill_attention = prefill_attention
        out.num_prefill_reqs, out.prefill_context_tokens = prefill_rows, prefill_context
        self._last_output, self._last_scheduled = out, scheduled
        return out

    def _scheduled_in(self, so: SchedulerOutput) -> list[tuple[Request, int, int]]:
        """(request, start, tokens) of each request ``so`` scheduled that is still known, in
        order: the step's own record when ``so`` is the latest output, else read from ``so``."""
        if so is self._last_output:
            return self._last_scheduled
        starts, requests = so.start_positions(), self._requests
        return [(req, starts[rid], n) for rid, n in so.num_scheduled_tokens.items()
                if (req := requests.get(rid)) is not None]

    # --- after the model ran ------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[tuple[Request, RequestOutput]]:
        """Advance computed tokens, append sampled tokens, apply stop rules, release finished
        requests. Returns an output for every request that got a token or finished (including
        those aborted or timed out since the last call).

        In two passes over the step: the first advances every request's computed tokens and
        hands them to the KV cache manager at once (`KVCacheManager.cache_step`, which records
        the written KV and registers full blocks, in the step's order); the second appends the
        sampled tokens. Nothing in the second pass touches the prefix cache (finishing frees
        blocks but neither stores nor evicts a hash), so the KV events and the pool's state are
        those of doing both per request; except a draft row's (speculative decoding): its
        verified positions are known only once its tokens are appended, so it registers its
        full blocks then (`_take_draft_row`), after the rows before it in the step may have
        freed theirs.

        The token counters count as vLLM's ``vllm:generation_tokens`` / ``vllm:prompt_tokens``
        do (its output processor, per engine output): ``num_generation_tokens_total`` +1 for
        every sampled token appended here, each of which goes out in the request's next output;
        ``num_prompt_tokens_total`` + the whole prompt (prefix-cache hits included) once per
        request, when its first token is sampled. A request that finishes before its first
        token (aborted, timed out, rejected) adds no prompt tokens, and recomputing a prompt
        after a preemption adds none again."""
        results: list[tuple[Request, RequestOutput]] = []
        for req in self._finished.values():
            results.append((req, self._make_output(req)))
        self._finished.clear()

        running_status = RequestStatus.RUNNING
        advanced: list[Request] = []    # aborted or preempted since the step was scheduled: out
        add = advanced.append
        drafts = so.scheduled_spec_decode_tokens
        for req, start, n in self._scheduled_in(so):
            if req.status is running_status and req.num_computed_tokens == start:
                # A draft row: only its first position counts for now; the accepted drafts'
                # positions join once their tokens are appended (`_take_draft_row`).
                req.num_computed_tokens = start + (1 if drafts and req.request_id in drafts
                                                   else n)
                add(req)
        self._last_output, self._last_scheduled = None, []
        self.kv.cache_step(advanced)

        finished_now = False
        sampled, logprobs, prompt_lps = out.sampled, out.logprobs, out.prompt_logprobs
        next_drafts = out.draft_token_ids
        ends = out.structured_ends
        max_model_len = self.max_model_len
        reported = self._num_reported
        now = self.clock()
        itl_values: list[float] = []    # this step's inter-token gaps, recorded in one call
        itl_priorities: list[int] = []
        num_generated = 0
        for req in advanced:
            outputs = req.output_token_ids
            computed = req.num_computed_tokens
            if computed != len(req.prompt_token_ids) + len(outputs):
                continue  # a prefill chunk short of the last token: nothing sampled
            rid = req.request_id
            reason: FinishReason | None = None
            if drafts and rid in drafts:
                before = len(outputs)
                reason = self._take_draft_row(req, drafts[rid], out.spec_sampled.get(rid), now,
                                              itl_values, itl_priorities)
                num_generated += len(outputs) - before
                token: int | None = outputs[-1]
            elif (token := sampled.get(rid)) is None:
                req.error = "the model runner returned no token for a sampling step"
                reason = FinishReason.ERROR
            else:
                outputs.append(token)
                num_generated += 1
                if logprobs and (entry := logprobs.get(rid)) is not None:
                    if req.output_logprobs is None:
                        req.output_logprobs = []
                    req.output_logprobs.append(entry)
                self._record_gap(req, now, itl_values, itl_priorities)
                sp = req.sampling
                if (token == req.eos_token_id or token in req.eos_token_ids
                        or token in sp.stop_token_ids
                        or len(outputs) >= sp.max_tokens or computed + 1 >= max_model_len):
                    reason = self._check_stop(req, token)
                if ends and rid in ends:
                    # Its grammar is complete (the output is whole: stop), or the matcher
                    # failed on the token.
                    error = ends[rid]
                    if error is None:
                        reason = FinishReason.STOP
                    else:
                        req.error, reason = error, FinishReason.ERROR
            if reason is not None:
                self._finish(req, reason, report_later=False)
                finished_now = True
                results.append((req, self._make_output(req)))
                if prompt_lps and token is not None:
                    results[-1][1].prompt_logprobs = prompt_lps.get(rid)
                continue
            if next_drafts:
                req.spec_token_ids = next_drafts.get(rid) or []
            # `_make_output` of a running request, inline: this line runs for every token.
            sent = reported.get(rid, 0)
            reported[rid] = num_outputs = len(outputs)
            cached = req.num_cached_tokens
            lps = req.output_logprobs
            results.append((req, RequestOutput(
                rid, outputs[sent:], False, None, None, len(req.prompt_token_ids),
                cached if cached > 0 else 0, num_outputs, req.num_preemptions, req.error,
                lps[sent:] if lps is not None else None,
                prompt_lps.get(rid) if prompt_lps else None)))
        self.num_generation_tokens_total += num_generated
        if itl_values:
            self.telemetry.run("latency", self.latency.observe_many, "itl_s", itl_values,
                               itl_priorities, now)
        if finished_now:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return results

    def _take_draft_row(self, req: Request, draft: list[int], emitted: list[int] | None,
                        now: float, itl_values: list[float], itl_priorities: list[int]
                        ) -> FinishReason | None:
        """Append what a draft row emitted (accepted drafts, then the target's token), token
        by token under the stop rules, and roll back the rest: ``num_computed_tokens`` ends
        at the verified tokens (the last one is fed next step, as after any decode), so the
        rejected positions' K/V — written in slots past it, in blocks the request keeps for
        its next tokens — are never read and are overwritten when those positions run; only
        then are the new positions recorded in the pool and offered to the prefix cache, so
        the cache never holds an unverified token. One inter-token gap per step (vLLM's
        per-iteration ITL); the request trace's gaps get 0 for the tokens that came with it.
        Counts vLLM's spec-decode metrics. Returns the finish reason, if any."""
        if not emitted:
            req.error = "the model runner returned no token for a draft row"
            return FinishReason.ERROR
        accepted = len(emitted) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(draft)
        self.spec_num_accepted_tokens += accepted
        per_pos = self.spec_accepted_per_pos
        for i in range(min(accepted, len(per_pos))):
            per_pos[i] += 1
        req.num_drafts += 1
        req.num_draft_tokens += len(draft)
        req.num_accepted_tokens += accepted
        outputs, sp = req.output_token_ids, req.sampling
        before = len(outputs)
        reason: FinishReason | None = None
        for token in emitted:
            outputs.append(token)
            if (token == req.eos_token_id or token in req.eos_token_ids
                    or token in sp.stop_token_ids or len(outputs) >= sp.max_tokens
                    or req.num_tokens >= self.max_model_len):
                reason = self._check_stop(req, token)
                if reason is not None:
                    break
        self._record_gap(req, now, itl_values, itl_priorities, len(outputs) - before - 1)
        if reason is None:
            req.num_computed_tokens = req.num_tokens - 1
            self.kv.cache_blocks(req)
        return reason

    # --- latency (on the scheduler's clock; `vconsole.engine.latency`) -------------------------
    def _record_gap(self, req: Request, now: float, itl_values: list[float],
                    itl_priorities: list[int], more_tokens: int = 0) -> None:
        """The step's token(s) of ``req`` arrived at ``now``: its inter-token gap (one per
        step, vLLM's per-iteration ITL), or its first token; ``more_tokens`` that came with it
        in the same step (a draft row's) get gaps of 0 in the request trace."""
        last = req.last_token_time
        if last is not None:
            gap = now - last
            itl_values.append(gap)
            itl_priorities.append(req.priority)
            req.token_gaps.append(gap)
            if more_tokens > 0:
                req.token_gaps.extend([0.0] * more_tokens)
        else:
            self._record_first_token(req, now)
        req.last_token_time = now

    def _record_first_token(self, req: Request, now: float) -> None:
        """A request's first sampled token (its later ones only add an ``itl_s`` gap, in bulk
        per step): TTFT, and its whole prompt counts as prompt tokens (see above)."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.telemetry.run("latency", self.latency.observe, "ttft_s",
                               now - req.arrival_time, req.priority, now)
        if len(req.output_token_ids) == 1:
            self.num_prompt_tokens_total += req.num_prompt_tokens

    def _record_finish(self, req: Request, reason: FinishReason) -> None:
        self.telemetry.run("latency", self._observe_finish, req, reason)

    def _observe_finish(self, req: Request, reason: FinishReason) -> None:
        now, lat, prio = self.clock(), self.latency, req.priority
        lat.finish(reason.value)
        lat.observe("e2e_s", now - req.arrival_time, prio, now)
        scheduled = req.first_scheduled_time
        if scheduled is not None:
            lat.observe("queue_s", scheduled - req.arrival_time, prio, now)
        first, last = req.first_token_time, req.last_token_time
        if scheduled is not None and first is not None and last is not None:
            lat.observe("prefill_s", first - scheduled, prio, now)
            lat.observe("decode_s", last - first, prio, now)
            lat.observe("inference_s", last - scheduled, prio, now)

    def latency_batch(self) -> LatencyBatch:
        """The latency observations since the last batch, taken out (for the publisher, which
        keeps the histograms and windows: `vconsole.engine.latency`)."""
        return self.latency.drain(self.clock(), self.config.latency_window_s)

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        """Stop reasons win over length: a model that emits EOS as its last allowed token has
        stopped on its own. The stop token stays in the output."""
        sp = req.sampling
        is_eos = token == req.eos_token_id or token in req.eos_token_ids
        if (is_eos and not sp.ignore_eos) or token in sp.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _make_output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        outputs = req.output_token_ids
        sent = self._num_reported.get(rid, 0)
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self._num_reported.pop(rid, None)
        else:
            self._num_reported[rid] = len(outputs)
        cached = req.num_cached_tokens
        lps = req.output_logprobs
        return RequestOutput(
            rid, outputs[sent:], finished,
            str(req.finish_reason) if finished and req.finish_reason else None, None,
            len(req.prompt_token_ids), cached if cached > 0 else 0, len(outputs),
            req.num_preemptions, req.error, lps[sent:] if lps is not None else None,
            timings=request_timings(req) if finished else None)

    # --- telemetry ----------------------------------------------------------------------------
    def stats(self, max_rows: int, rows: RowSource | None = None) -> SchedulerStats:
        """Queue figures and up to ``max_rows`` request rows, made by ``rows`` (the publishing
        side's `RowSource`; required when ``max_rows`` > 0): running first, then compiling,
        then waiting in queue order. For telemetry, not per step."""
        if max_rows > 0 and rows is None:
            raise ValueError(f"{max_rows} request rows asked for and no RowSource to make them "
                             "(vconsole.engine.publish.request_rows.RequestRows)")
        cfg, now = self.config, self.clock()
        total = len(self.running) + len(self.compiling) + len(self.waiting)
        table: RequestTable | list = []
        if rows is not None:
            head = self.running[:max(0, max_rows)]
            if self.compiling and len(head) < max_rows:
                head = head + list(self.compiling.values())[:max_rows - len(head)]
            rest = max(0, max_rows - len(head))
            table = rows.table(head, self.kv.tables, self.waiting, rest, now)
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running),
            num_preempted=self._num_preempted_waiting,
            num_preemptions_total=self.num_preemptions_total,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            policy=cfg.policy, num_finished_total=self.num_finished_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            requests=table, requests_truncated=total > min(max_rows, total),
            num_compiling=len(self.compiling), spec_decode=self.spec_stats(max_rows))

    def spec_stats(self, max_rows: int) -> dict[str, Any] | None:
        """`SchedulerStats.spec_decode`: None when speculation is not configured."""
        if self.spec is None:
            return None
        rows = {r.request_id: [r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens]
                for r in self.running[:max(0, max_rows)] if r.num_drafts}
        return {"enabled": self.config.speculative_decoding, "requests": rows,
                "num_speculative_tokens": self.spec.num_speculative_tokens,
                "num_drafts": self.spec_num_drafts,
                "num_draft_tokens": self.spec_num_draft_tokens,
                "num_accepted_tokens": self.spec_num_accepted_tokens,
                "accepted_per_pos": list(self.spec_accepted_per_pos)}

    def kv_stats(self) -> KVStats:
        return self.kv.kv_stats()

    def rebuild_telemetry(self, part: str) -> None:
        """Drop the caches of ``part`` after it failed (`TelemetryGuard`): the next snapshot
        builds them from the truth (the block pool). Latency drops the observations not yet
        handed over (the publisher keeps the histograms). The ``sched`` table's caches are its
        `RowSource`'s (the telemetry feed resets them)."""
        if part == "kv":
            self.kv.pool.recount()
        elif part == "latency":
            finished = dict(self.latency.finished)
            self.latency = LatencyLog()
            self.latency.finished = finished
