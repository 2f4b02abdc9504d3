"""A request's life inside the engine: its tokens, state and why it finished (what it asked
for, its `SamplingParams`, is wire data: `vconsole.wire.sampling`).

The one rule the scheduler follows (as in vLLM v1): a request's ``num_computed_tokens`` catches up
to ``len(all_token_ids)``. Prefill, chunked prefill, decode and recompute after preemption are all
that rule; when it has caught up, the model samples the next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from vconsole.wire.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after its blocks were taken back; will recompute
    FINISHED = 3
    COMPILING = 4  # its structured-output grammar compiles (off the busy loop); not schedulable

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.StrEnum):
    LENGTH = "length"    # max_tokens or max_model_len reached
    STOP = "stop"        # EOS or a stop token
    ABORT = "abort"      # aborted by the client
    TIMEOUT = "timeout"  # waited longer than max_holding_seconds
    ERROR = "error"      # rejected (bad input) or failed


# One output token's logprobs: (its logprob, the top ids, their logprobs), from the raw logits.
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    client_id: bytes = b""
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every EOS id of the model (some have several)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] | None = None  # beside output_token_ids, if asked
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1      # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    seq_no: int = 0                  # admission order, set by the scheduler (ties and fcfs)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None   # on the scheduler's clock (latency metrics)
    last_token_time: float | None = None
    # The gaps between its output tokens after the first (s): the request trace's ITLs.
    token_gaps: list[float] = field(default_factory=list)
    # Structured output: how long its grammar took to compile, or to come out of the cache
    # (ms; 0 until compiled); its grammar state (`vconsole.engine.structured.manager`'s, owned
    # by the request while it lives).
    compile_ms: float = 0.0
    grammar: Any = None
    # collect_detailed_traces: the summed schedule, model forward and model execute time of
    # the steps it ran in (ns; 0 while the key is off).
    scheduler_ns: int = 0
    forward_ns: int = 0
    execute_ns: int = 0
    # Speculative decoding (`vconsole.engine.spec`): the draft proposed for its next step
    # (consumed when scheduled), and its own counts: steps that ran a draft, drafted tokens,
    # of those accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def constraint(self) -> int:
        """The request table's ``constraint`` code: 0 none, else 1 + the index of its
        structured-output kind in `vconsole.wire.sampling.STRUCTURED_KINDS`."""
        spec = self.sampling.structured
        return 0 if spec is None else spec.code

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has not had them: its next schedule computes the
        whole prompt, never reading the prefix cache (as vLLM v1). They come with the first
        output token, so a request preempted later reads the cache again."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids


def request_timings(req: Request) -> dict[str, float]:
    """A finished request's phases in seconds on the scheduler's clock, those it reached:
    ``queue_s`` (first scheduled - arrival), ``prefill_s`` (first token - first scheduled),
    ``decode_s`` (last token - first token), ``inference_s`` (last token - first scheduled);
    the definitions of `vconsole.engine.latency`. With ``collect_detailed_traces`` also the
    sums over the steps it ran in: ``scheduler_s``, ``forward_s``, ``execute_s``. Its final
    output carries them."""
    out: dict[str, float] = {}
    scheduled, first, last = req.first_scheduled_time, req.first_token_time, req.last_token_time
    if scheduled is not None:
        out["queue_s"] = scheduled - req.arrival_time
        if first is not None and last is not None:
            out["prefill_s"] = first - scheduled
            out["decode_s"] = last - first
            out["inference_s"] = last - scheduled
    if req.execute_ns:
        out["scheduler_s"] = req.scheduler_ns / 1e9
        out["forward_s"] = req.forward_ns / 1e9
        out["execute_s"] = req.execute_ns / 1e9
    return out
