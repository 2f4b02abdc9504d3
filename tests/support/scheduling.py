"""Builders shared by the scheduler, KV-cache and model-runner tests (as vLLM's
``tests/v1/core/utils.py``): schedulers and requests with compact defaults, and `RunnerFeed`,
which hands a model runner plain `SchedulerOutput`s the way the scheduler does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from vconsole.engine.request import Request
from vconsole.engine.sched.output import NewRequestData, SchedulerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, max_model_len: int = 512,
                   clock: Callable[[], float] | None = None, *, block_size: int = BLOCK_SIZE,
                   **config: object) -> Scheduler:
    """A Scheduler over ``num_blocks`` blocks of ``block_size``; ``config`` are EngineConfig
    fields (policy, max_num_seqs, ...)."""
    kw = {"clock": clock} if clock else {}
    return Scheduler(EngineConfig(**config), num_blocks, block_size, max_model_len, **kw)


def make_request(rid: str, prompt: int | list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None, eos: int | None = None,
                 **sampling: object) -> Request:
    """A request; an int ``prompt`` is that many tokens distinct per id (no accidental prefix
    sharing between requests)."""
    if isinstance(prompt, int):
        base = 1 + zlib.crc32(rid.encode()) % 10_000 * 100
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    extra = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sampling),
                   priority=priority, eos_token_id=eos, **extra)


Chunk = tuple[Request, int, int, list[int]]  # (request, start, end, block table)


class RunnerFeed:
    """Turns ``(request, start, end, blocks)`` chunks into `SchedulerOutput`s for a model
    runner, as the scheduler would: a request this feed has not sent yet goes whole (after
    telling the runner to forget any older request of that id), later ones only the tokens and
    blocks added since. Block tables must only grow between calls for the same request.

    ``fresh=True`` sends every chunk whole, which any runner state must accept as well.
    """

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int]] = {}  # id -> (tokens, blocks) the runner holds

    def __call__(self, *chunks: Chunk, fresh: bool = False) -> SchedulerOutput:
        out = SchedulerOutput()
        for req, start, end, blocks in chunks:
            rid = req.request_id
            held = None if fresh else self.sent.get(rid)
            if held is None:
                out.finished_req_ids.add(rid)
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, list(req.prompt_token_ids), list(req.output_token_ids), req.sampling,
                    list(blocks), start))
            else:
                num_tokens, num_blocks = held
                out.scheduled_cached_reqs.append(rid, req.all_token_ids[num_tokens:],
                                                 list(blocks[num_blocks:]), start)
            self.sent[rid] = (req.num_tokens, len(blocks))
            out.num_scheduled_tokens[rid] = end - start
            num_prefill = max(0, min(end, req.num_prompt_tokens) - start)
            out.num_prefill_tokens += num_prefill
            out.num_decode_tokens += end - start - num_prefill
        return out
