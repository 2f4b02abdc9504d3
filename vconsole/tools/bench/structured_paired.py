"""`bench structured`'s paired steps: what a grammar costs a step, with the machine's drift
cancelled.

On shared cores two runs of the same workload differ by more than the 5% the throughput goal
allows, so the end-to-end tok/s ratio cannot tell 0.93 from 0.97. Here two engine cores live in
this process, the same model in each: ``A`` serves the workload under its schemas, ``B`` the
same prompts unconstrained with ``ignore_eos`` and ``max_tokens`` set to A's output lengths
(learnt in a first pass of A alone, which also fills A's grammar cache). Both run the same
closed loop (``concurrency`` in flight, a finished request letting the next in), so their
batches are the same at every step, and they step in turn — A, B, A, B — so a burst of load
from elsewhere hits both sides of a pair alike.

Figures: the per-pair ratio of A's step time to B's (median, p10, p90), the ratio of their
summed step times (``busy_ratio``; the throughput ratio is its inverse, both sides computing
the same tokens), the median of A's ``structured`` phase (bitmask filled and applied, matchers
advanced) and of the pairs' ``execute`` ratio. What this leaves out is the engine process's
other threads (sockets, output) taking the GIL while a matcher call drops it: the end-to-end
runs measure that, with their noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import StepStats
from vconsole.wire.sampling import SamplingParams, StructuredSpec

Log = Callable[[str], None]
MAX_TOKENS = 256


class _Side:
    """One core and its closed loop over ``jobs``: ``spec`` or ``lengths`` decide its side."""

    def __init__(self, core: EngineCore, jobs: list[Any], concurrency: int, tag: str,
                 lengths: list[int] | None) -> None:
        self.core, self.jobs, self.tag, self.lengths = core, jobs, tag, lengths
        self.queue = list(reversed(jobs))
        self.concurrency = concurrency
        self.live = 0
        self.output_lengths: dict[int, int] = {}
        self.steps: list[StepStats] = []

    def fill(self) -> None:
        while self.queue and self.live < self.concurrency:
            job = self.queue.pop()
            if self.lengths is None:
                sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                          structured=StructuredSpec("json",
                                                                    job.case.schema_text))
            else:
                sampling = SamplingParams(max_tokens=self.lengths[job.index], temperature=0.0,
                                          ignore_eos=True)
            self.core.add_request(self.core.make_request(
                f"{self.tag}-{job.index}", prompt_token_ids=job.prompt_ids, sampling=sampling))
            self.live += 1

    @property
    def busy(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> None:
        outputs, _ = self.core.step()
        if self.core.last_step is not None:
            self.steps.append(self.core.last_step)
        for outs in outputs.values():
            for out in outs:
                if out.finished:
                    self.live -= 1
                    self.output_lengths[int(out.request_id.rsplit("-", 1)[1])] = \
                        out.num_output_tokens
        self.fill()


def _run(sides: list[_Side]) -> None:
    for side in sides:
        side.fill()
    while any(side.busy for side in sides):
        for side in sides:
            if side.busy:
                side.step()


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def paired_steps(model_path: str, jobs: list[Any], concurrency: int,
                 log: Log | None = None) -> dict[str, Any]:
    """The figures of the module docstring for ``jobs`` (`structured.workload`'s)."""
    say = log or (lambda _m: None)

    def new_core() -> EngineCore:
        return EngineCore(EngineConfig(model=model_path, max_num_seqs=max(64, concurrency),
                                       enable_prefix_caching=False))

    say(f"paired steps: two cores in this process, concurrency {concurrency}")
    constrained = _Side(new_core(), jobs, concurrency, "a0", None)
    _run([constrained])                        # A's lengths; A's grammars compiled and cached
    lengths = [max(1, constrained.output_lengths[j.index]) for j in jobs]
    free = new_core()
    _run([_Side(free, jobs[:2], 2, "warm", [4] * len(jobs))])      # B's first forwards
    a = _Side(constrained.core, jobs, concurrency, "a", None)
    b = _Side(free, jobs, concurrency, "b", lengths)
    _run([a, b])
    if sorted(a.output_lengths.values()) != sorted(lengths):
        say("paired steps: the constrained side's lengths changed between passes")
    pairs = list(zip(a.steps, b.steps, strict=False))
    ratios = [x.total_ns / y.total_ns for x, y in pairs if y.total_ns > 0]
    execute = [x.execute_ns / y.execute_ns for x, y in pairs if y.execute_ns > 0]
    busy_a = sum(s.total_ns for s in a.steps)
    busy_b = sum(s.total_ns for s in b.steps)
    return {
        "concurrency": concurrency,
        "steps": [len(a.steps), len(b.steps)],
        "same_batches": len(a.steps) == len(b.steps) and all(
            (x.num_prefill_tokens, x.num_decode_tokens)
            == (y.num_prefill_tokens, y.num_decode_tokens) for x, y in pairs),
        "step_ratio_median": round(statistics.median(ratios), 3),
        "step_ratio_p10": round(_q(ratios, 0.1), 3),
        "step_ratio_p90": round(_q(ratios, 0.9), 3),
        "busy_ratio": round(busy_a / busy_b, 3),
        "throughput_ratio": round(busy_b / busy_a, 3),
        "structured_ms_median": round(statistics.median(s.structured_ns for s in a.steps)
                                      / 1e6, 2),
        "execute_ratio_median": round(statistics.median(execute), 3),
    }
