"""`bench structured`'s closed-loop runs against a live engine: the workload's requests
(`workload`, the schema in the system prompt), `run_jobs` keeping ``concurrency`` of them in
flight over the engine client, and a run's output figures (`run_figures`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vconsole.tools.bench.structured_schemas import SCHEMAS, SchemaCase

MAX_TOKENS = 256          # above any schema's longest instance, even at a byte per token
SYSTEM = "You reply with one JSON object and nothing else. It follows this JSON schema: "


@dataclass
class Job:
    """One request of the workload: its prompt, its case and, when constrained, its spec."""

    index: int
    case: SchemaCase
    prompt_ids: list[int]


@dataclass
class Done:
    """One request's outcome: its output tokens, how it ended, and when it was sent and
    finished (wall clock)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    submitted: float
    finished: float


def workload(renderer: Any, num: int) -> list[Job]:
    """``num`` chat prompts, cycling the schemas; each asks for its object, the schema in the
    system prompt (as a deployment would write it)."""
    from vconsole.tools.prompts import ChatPrompt

    jobs = []
    for i in range(num):
        case = SCHEMAS[i % len(SCHEMAS)]
        prompt = ChatPrompt(SYSTEM + case.schema_text, f"{case.prompt} Example {i + 1}.")
        jobs.append(Job(i, case, renderer.ids(prompt)))
    return jobs


def run_jobs(endpoints: dict[str, str], jobs: list[Job], concurrency: int, *,
             constrained: bool, max_tokens: list[int], ignore_eos: bool = False,
             timeout_s: float = 1800.0) -> tuple[list[Done], float]:
    """The jobs closed-loop at ``concurrency`` in flight, greedy; each finished request lets
    the next in. Returns every request's outcome (in job order) and the elapsed seconds from
    the first submit to the last final output."""
    from vconsole.engine.client.client import Completion, EngineClient

    with EngineClient(endpoints["input"], endpoints["output"], timeout_s=60) as client:
        queue = list(reversed(jobs))
        live: dict[str, tuple[Job, Completion, float]] = {}
        done: dict[int, Done] = {}

        def submit() -> None:
            job = queue.pop()
            extra: dict[str, Any] = {}
            if constrained:
                extra["structured"] = {"kind": "json", "value": job.case.schema_text}
            if ignore_eos:
                extra["ignore_eos"] = True
            rid = client.submit(prompt_token_ids=job.prompt_ids,
                                max_tokens=max_tokens[job.index], temperature=0.0, **extra)
            live[rid] = (job, Completion(rid), time.perf_counter())

        t0 = time.perf_counter()
        while queue and len(live) < concurrency:
            submit()
        for out in client.outputs(timeout_s):
            job, comp, sent = live[out.request_id]
            comp.add(out)
            if out.finished:
                del live[out.request_id]
                done[job.index] = Done(job.index, comp.output_token_ids, comp.finish_reason,
                                       comp.error, sent, time.perf_counter())
                if queue:
                    submit()
        elapsed = time.perf_counter() - t0
    return [done[j.index] for j in jobs], elapsed


def run_figures(done: list[Done], elapsed: float) -> dict[str, Any]:
    """A run's output tokens, elapsed seconds, output tok/s and finish reasons."""
    tokens = sum(len(d.token_ids) for d in done)
    return {"output_tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tok_per_s": round(tokens / elapsed, 2) if elapsed else None,
            "finish_reasons": dict(Counter(str(d.finish_reason) for d in done))}

