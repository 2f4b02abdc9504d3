"""What one `schedule()` hands to the model runner, and what the runner hands back.

This is the contract between `vconsole.engine.sched.scheduler` and `vconsole.engine.worker.model_runner`: plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vconsole.engine.request import Request


@dataclass
class ScheduledSeq:
    """One request's share of a step: feed ``token_ids`` at positions ``start_pos ..``.

    ``block_ids`` is the request's whole block table (it already covers every position written
    this step); token at position p lives in slot ``block_ids[p // B] * B + p % B``.
    ``do_sample`` is true when, after this chunk, the request has caught up with its tokens and
    the next token must be sampled from the logits of the chunk's last position.
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    do_sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.start_pos < self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class ModelRunnerOutput:
    """Sampled token per request whose ``do_sample`` was set, keyed by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
