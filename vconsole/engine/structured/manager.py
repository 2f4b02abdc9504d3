"""The engine core's structured outputs (vLLM's ``StructuredOutputManager``, llguidance).

A request's life here:

1. `start` (at ``add_request``): its spec goes to the compiler (`GrammarCompiler`: its own
   threads, an LRU cache by spec). The scheduler holds the request aside, ``compiling``.
2. When the compile is done, a pool thread appends the id to a ready list and calls ``wake``
   (the engine process's busy loop may be blocked on its input queue with only compiling
   requests: that wakes it; no polling). `take_ready`, at the start of the next step, gives the
   request its own matcher (a copy of the compiled prototype) and hands it back to the core,
   which queues it in the scheduler, or finishes it with ``error`` when the grammar did not
   compile.
3. Each step, `fill` writes the next-token bitmask of every constrained request that samples in
   it into one int32 bitmask (with 4 cores or more llguidance's `LLExecutor` fills the rows
   in parallel in Rust threads, the GIL dropped; else one call a row); the runner applies it
   to the logits before sampling (`vconsole.engine.worker.sampler.apply_token_bitmask`).
4. `advance` consumes each of those rows' sampled token. A matcher that is stopped afterwards
   (the grammar is complete; an EOS it allowed is one way) ends its request with ``stop``; one
   that refused the token ends it with ``error``.
5. `forget`, when the request finishes, drops its matcher.

Preemption and recompute need nothing: the matcher has consumed exactly the request's output
tokens (which the engine keeps), and only a step that samples a *new* token advances it — a
recompute's prefill re-runs tokens the matcher already has and samples the next one, which is
new. A step with no constrained row costs one ``if`` (`active` is empty: no bitmask, nothing
for the runner).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from llguidance import LLExecutor, LLMatcher

from vconsole.engine.request import Request
from vconsole.engine.sched.output import GrammarBatch, ModelRunnerOutput, SchedulerOutput
from vconsole.engine.structured.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    build_tokenizer,
)
from vconsole.engine.structured.grammar import PREFIX, first_line

# The bitmask is filled by LLExecutor's Rust threads (the GIL dropped) only where cores are
# free beside the forward's: on 2 shared cores one-by-one fills were as fast or faster
# (docs/structured.md, "Why llguidance": 2.5 ms one by one vs 3.4 ms batched for 32 rows
# on smollm2's vocabulary; torch's threads already hold both cores).
_CPUS = os.cpu_count() or 1
PAR_MIN_ROWS = 2 if _CPUS >= 4 else 1 << 30
EXECUTOR_THREADS = max(2, min(8, _CPUS // 2))


class GrammarState:
    """A request's grammar state: its own matcher, advanced by every token it outputs."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher


class StructuredOutputs:
    """See the module docstring. Everything but the compile runs on the busy loop."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], *,
                 compiler: GrammarCompiler | None = None) -> None:
        self.compiler = compiler or GrammarCompiler(
            lambda: build_tokenizer(hf_tokenizer, vocab_size, eos_token_ids))
        self.active: dict[str, Request] = {}   # compiled, waiting or running: have a matcher
        # Compiling: request, its future, when it was submitted, whether the cache had it.
        self._pending: dict[str, tuple[Request, Future[CompiledGrammar], float, bool]] = {}
        # (id, its compile), appended by the pool's threads
        self._ready: deque[tuple[str, Future[CompiledGrammar]]] = deque()
        self._ready_event = threading.Event()
        self.wake: Callable[[], None] | None = None   # the busy loop's wake-up, if it sleeps
        self._executor: LLExecutor | None = None
        self._fill_thread: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    # --- compile ------------------------------------------------------------------------------
    def start(self, req: Request) -> None:
        """Compile ``req``'s spec (off the loop); the request waits in the scheduler."""
        spec = req.sampling.structured
        assert spec is not None
        fut, hit = self.compiler.submit(spec)
        rid = req.request_id
        self._pending[rid] = (req, fut, time.perf_counter(), hit)
        fut.add_done_callback(functools.partial(self._on_done, rid))

    def _on_done(self, rid: str, fut: Future[CompiledGrammar]) -> None:
        """A pool thread (or the loop, for a cached grammar): ``rid``'s compile ``fut`` is
        done. The future goes with the id: an id aborted while compiling may come back with
        another spec before this compile ends, and only its own compile may release it."""
        self._ready.append((rid, fut))
        self._ready_event.set()
        wake = self.wake
        if wake is not None:
            wake()

    def has_ready(self) -> bool:
        return bool(self._ready)

    @property
    def num_compiling(self) -> int:
        return len(self._pending)

    def wait_ready(self, timeout: float) -> bool:
        """Block until a compile is done (offline runs, tests: the engine process is woken
        through ``wake`` instead)."""
        if self._ready:
            return True
        self._ready_event.clear()
        if self._ready:
            return True
        return self._ready_event.wait(timeout)

    def take_ready(self) -> list[tuple[Request, str | None]]:
        """Requests whose compile finished since the last call, each with None (it now has its
        matcher, and ``compile_ms``) or the reason its grammar cannot be used."""
        out: list[tuple[Request, str | None]] = []
        ready = self._ready
        pending = self._pending
        while ready:
            rid, done = ready.popleft()
            entry = pending.get(rid)
            if entry is None or entry[1] is not done:
                continue        # finished meanwhile, or the id was reused for a new compile
            del pending[rid]
            req, fut, submitted, hit = entry
            if fut.cancelled():
                out.append((req, f"{PREFIX}the engine stopped compiling grammars"))
                continue
            result = fut.result()
            if result.matcher is None:
                out.append((req, result.error))
                continue
            req.grammar = GrammarState(result.matcher.deep_copy())
            # A cached grammar's cost is the wait for it (a copy, or the end of a compile
            # another request started); a compile's is its own wall time.
            req.compile_ms = 1000.0 * ((time.perf_counter() - submitted) if hit
                                       else result.compile_s)
            self.active[req.request_id] = req
            out.append((req, None))
        return out

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that finished: drop their matchers (and any compile still pending for
        them: its result is ignored)."""
        active, pending = self.active, self._pending
        for rid in request_ids:
            req = active.pop(rid, None)
            if req is not None:
                req.grammar = None
            pending.pop(rid, None)

    # --- each step ----------------------------------------------------------------------------
    def fill(self, so: SchedulerOutput, *, overlap: bool = False) -> GrammarBatch | None:
        """The bitmask of this step's constrained rows that sample (None if there are none).
        Call after `schedule` (computed tokens are still the step's start positions).
        ``overlap``: fill it on the fill thread while the forward runs (the matchers are only
        read until `advance`); the batch's ``ready`` says when it is done."""
        scheduled = so.num_scheduled_tokens
        rows: dict[str, int] = {}
        matchers: list[tuple[LLMatcher, int]] = []
        for rid, req in self.active.items():
            n = scheduled.get(rid)
            if n is not None and req.num_computed_tokens + n == req.num_tokens:
                matchers.append((req.grammar.matcher, len(rows)))
                rows[rid] = len(rows)
        self._last_rows = rows
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(rows))
        if overlap:
            if self._fill_thread is None:
                self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="vconsole-mask")
            return GrammarBatch(rows, bitmask, self._fill_thread.submit(
                self._fill_rows, matchers, bitmask))
        self._fill_rows(matchers, bitmask)
        return GrammarBatch(rows, bitmask)

    def _fill_rows(self, matchers: list[tuple[LLMatcher, int]], bitmask: torch.Tensor) -> None:
        """llguidance writes each row's mask straight into ``bitmask`` (a contiguous CPU int32
        tensor of ours). Called as ``llguidance.torch``'s fill functions do, without importing
        that module: its ``@torch.compile`` kernel pulls in torch's dynamo and inductor, 2.2 s
        of CPU at every engine start for a function the engine never calls."""
        rows = bitmask.shape[0]
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
                or not bitmask.is_contiguous() or any(not 0 <= r < rows for _, r in matchers)):
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor holding every "
                             "row: llguidance writes to its memory directly")
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if len(matchers) >= PAR_MIN_ROWS:
            if self._executor is None:
                self._executor = LLExecutor(EXECUTOR_THREADS)
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, rows)
        else:
            base = bitmask.data_ptr()
            for matcher, row in matchers:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of one reused int32 bitmask (grown by doubling). Reuse is
        safe: the runner is done with the step's rows when it returns its tokens."""
        if self._bitmask is None or self._bitmask.shape[0] < n:
            words = (self.compiler.vocab_size + 31) // 32
            rows = max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = torch.empty((rows, words), dtype=torch.int32)
        return self._bitmask[:n]

    def advance(self, out: ModelRunnerOutput) -> None:
        """Consume each masked row's sampled token; record in ``out.structured_ends`` the
        requests whose grammar is complete (None) or whose matcher failed (its error)."""
        sampled, ends = out.sampled, out.structured_ends
        active = self.active
        for rid in self._last_rows:
            token = sampled.get(rid)
            if token is None:
                continue     # the step failed: nothing sampled, nothing consumed
            matcher = active[rid].grammar.matcher
            if not matcher.consume_token(token):
                ends[rid] = PREFIX + (first_line(matcher.get_error())
                                      or f"token {token} is not allowed here")
            elif matcher.is_stopped():
                ends[rid] = None
        self._last_rows = {}

    def close(self) -> None:
        self.compiler.close()
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=False)
