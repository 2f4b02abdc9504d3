"""Offline batch inference: run a list of requests through an in-process EngineCore to the end.

This is the engine without sockets — what `vconsole generate`, the benchmarks and the
correctness tests use. The same `step()` loop as the live engine process, driven to completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.engine.request import Request
from vconsole.shared.config import EngineConfig
from vconsole.wire.outputs import Logprobs, PromptLogprobs, RequestOutput
from vconsole.wire.sampling import SamplingParams


@dataclass
class BatchResult:
    outputs: list[RequestOutput]          # input order
    output_token_ids: list[list[int]]     # input order; empty for rejected requests
    elapsed_s: float
    num_steps: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    step_log: list[Any] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.output_token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def run_batch(core: EngineCore, requests: Sequence[Request | RequestOutput],
              on_progress: Callable[[int, int], None] | None = None,
              keep_step_log: bool = False) -> BatchResult:
    """Add every request, step until all are finished, return results in input order.

    An entry that is already a finished `RequestOutput` (a request rejected while it was being
    built) is passed through at its index, so callers keep one list in input order. Each
    finished output gets its ``text`` here (`EngineCore.step` never detokenizes), and, when the
    request asked, every token's ``logprobs`` (each step's output carries only its new tokens')
    and the ``prompt_logprobs`` (they came with its first token).
    """
    index: dict[str, int] = {}
    running: dict[str, Request] = {}
    results: list[RequestOutput | None] = [None] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    prompt_lps: dict[int, PromptLogprobs] = {}
    token_lps: dict[int, list[Logprobs]] = {}
    kv0 = core.kv_stats()
    t0 = time.perf_counter()
    steps0 = core.num_steps
    done = 0
    for i, req in enumerate(requests):
        if isinstance(req, RequestOutput):
            results[i] = req
            done += 1
            continue
        if req.request_id in index:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        index[req.request_id] = i
        rejected = core.add_request(req)
        if rejected is not None:
            results[i] = rejected
            done += 1
        else:
            running[req.request_id] = req
    log: list[Any] = []
    while core.has_unfinished_requests():
        if not core.has_ready_requests():   # only grammars compiling: wait, do not spin
            core.structured.wait_ready(0.05)
            continue
        outputs, _ = core.step()
        if keep_step_log and core.last_step is not None:
            log.append(core.last_step)
        for outs in outputs.values():
            for out in outs:
                i = index[out.request_id]
                tokens[i].extend(out.new_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                if out.logprobs is not None:
                    token_lps.setdefault(i, []).extend(out.logprobs)
                if out.finished:
                    req = running.pop(out.request_id)
                    out.text = core.detokenize(req.output_token_ids)
                    out.prompt_logprobs = prompt_lps.pop(i, None)
                    out.logprobs = token_lps.pop(i, None)
                    results[i] = out
                    done += 1
        if on_progress is not None:
            on_progress(done, len(requests))
    elapsed = time.perf_counter() - t0
    kv1 = core.kv_stats()
    final = [r for r in results if r is not None]
    assert len(final) == len(requests), "every request must finish"
    return BatchResult(
        outputs=final, output_token_ids=tokens, elapsed_s=elapsed,
        num_steps=core.num_steps - steps0,
        num_preemptions=sum(o.num_preemptions for o in final),
        prefix_queries=kv1.prefix_queries - kv0.prefix_queries,
        prefix_hits=kv1.prefix_hits - kv0.prefix_hits, step_log=log)


def greedy_requests(core: EngineCore, prompts: Sequence[list[int]], max_tokens: int | Sequence[int],
                    *, priorities: Sequence[int] | None = None, ignore_eos: bool = False,
                    prefix: str = "r") -> list[Request]:
    """Greedy requests over token-id prompts — the shape tests and benchmarks use."""
    reqs = []
    for i, ids in enumerate(prompts):
        n = max_tokens if isinstance(max_tokens, int) else max_tokens[i]
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
        reqs.append(core.make_request(f"{prefix}{i}", prompt_token_ids=list(ids), sampling=sp,
                                      priority=priorities[i] if priorities else 0))
    return reqs


def make_core(**overrides: Any) -> EngineCore:
    return EngineCore(EngineConfig(**overrides))
