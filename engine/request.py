"""A request's life inside the engine: its parameters, tokens, state and why it finished.

The one rule the scheduler follows (as in vLLM v1): a request's ``num_computed_tokens`` catches up
to ``len(all_token_ids)``. Prefill, chunked prefill, decode and recompute after preemption are all
that rule; when it has caught up, the model samples the next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after its blocks were taken back; will recompute
    FINISHED = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.StrEnum):
    LENGTH = "length"    # max_tokens or max_model_len reached
    STOP = "stop"        # EOS or a stop token
    ABORT = "abort"      # aborted by the client
    TIMEOUT = "timeout"  # waited longer than max_holding_seconds
    ERROR = "error"      # rejected (bad input) or failed


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1      # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    seq_no: int = 0                  # admission order, set by the scheduler (ties and fcfs)
    first_scheduled_time: float | None = None

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
