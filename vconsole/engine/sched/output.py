"""What one `schedule()` hands to the model runner, and what the runner hands back.

This is the contract between `vconsole.engine.sched.scheduler` and
`vconsole.engine.worker.model_runner`: plain data, no torch, and never a live `Request` — the
runner keeps its own copy of what it needs per request, so it could run in another process.

As in vLLM v1 (``NewRequestData`` / ``CachedRequestData``), a request the runner has not seen
is sent whole, once (`NewRequestData`); from then on each step carries only what changed
(`CachedRequestData`: tokens sampled since, blocks added since, where feeding starts). The
runner forgets a request when it appears in ``finished_req_ids`` or ``preempted_req_ids``; a
preempted request that is scheduled again comes back as new (its blocks were freed).

Invariants, for every request id ``r`` in ``num_scheduled_tokens``:
  * ``r`` is in exactly one of ``scheduled_new_reqs`` / ``scheduled_cached_reqs``;
  * the runner's tokens for ``r`` (new: prompt + outputs; cached: what it had + ``new_token_ids``)
    cover positions ``0 .. num_computed_tokens + num_scheduled_tokens[r] - 1``, and its block
    table covers every one of those positions;
  * the runner samples for ``r`` exactly when ``num_computed_tokens + num_scheduled_tokens[r]``
    equals its number of tokens (plus its draft's, when ``r`` has one in
    ``scheduled_spec_decode_tokens``: drafts are fed but never become the runner's tokens);
  * a request sent new with ``sampling.prompt_logprobs`` and no output tokens starts at
    position 0 (no prefix-cache hit): the runner computes every prompt position's logprobs
    and returns them all in the step that samples its first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vconsole.wire.outputs import PromptLogprobs
from vconsole.wire.sampling import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet (first schedule, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # already sampled: a resumed request recomputes their KV
    sampling: SamplingParams
    block_ids: list[int]            # the whole block table
    num_computed_tokens: int        # KV already in the pool (prefix-cache hit): feeding starts here


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as parallel lists: only what changed since their
    previous step."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)   # sampled since, in order
    new_block_ids: list[list[int]] = field(default_factory=list)   # appended to the table since
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, new_token_ids: list[int], new_block_ids: list[int],
               num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class GrammarBatch:
    """Structured output's part of a step (`vconsole.engine.structured.manager`): the
    next-token bitmask of every constrained request that samples this step, filled before the
    runner runs. Row ``rows[r]`` of ``bitmask`` is request ``r``'s: bit ``t`` (word ``t // 32``,
    bit ``t % 32``) set iff token ``t`` may come next; tokens past the bitmask's width never may.
    ``bitmask``: an int32 CPU tensor of (len(rows), words) — the one torch object of this
    module's contract, typed Any so the scheduler's side stays torch-free. ``ready``: None when
    the bitmask is filled already, else a future the runner waits on before it reads the
    bitmask (filled on another thread while the forward runs, as vLLM overlaps it on GPUs)."""

    rows: dict[str, int]
    bitmask: Any
    ready: Any = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Tokens to run this step per request, in the order the scheduler chose them.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)   # since the previous step
    preempted_req_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # What attention reads this step (the request trace's step-cost features): the sum over
    # scheduled requests of the positions they attend to (start + n), and over prefill chunks
    # (n > 1) of n x (start + n).
    num_context_tokens: int = 0
    prefill_attention: int = 0
    # The prefill chunks (n > 1) among them and the sum of their (start + n): with the two
    # above, vLLM's ``ExecutionContext`` of the step (the MFU counters: `publish.mfu`).
    num_prefill_reqs: int = 0
    prefill_context_tokens: int = 0
    # The constrained rows' bitmask (None when no sampled row is constrained: the runner does
    # no structured-output work at all).
    grammar: GrammarBatch | None = None
    # Speculative decoding (`vconsole.engine.spec`): per decode row that runs a draft, the
    # drafted tokens, fed after the row's last token in the same forward (its
    # ``num_scheduled_tokens`` is 1 + len(draft)); the runner returns what it kept in
    # ``ModelRunnerOutput.spec_sampled``. ``propose_drafts``: the runner proposes the next
    # step's drafts (speculation configured and not paused).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def start_positions(self) -> dict[str, int]:
        """Where each scheduled request's tokens start this step (its ``num_computed_tokens``)."""
        starts = {r.req_id: r.num_computed_tokens for r in self.scheduled_new_reqs}
        cached = self.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return starts

    def has_work(self) -> bool:
        """Anything for the runner: tokens to run, or requests to forget."""
        return bool(self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids)


@dataclass
class ModelRunnerOutput:
    """Sampled token per request that reached its last token this step, keyed by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
    # (logprob, top ids, top logprobs) of the sampled token, for requests that asked.
    logprobs: dict[str, tuple[float, list[int], list[float]]] = field(default_factory=dict)
    # The whole prompt's logprobs, for requests that asked, in the step of their first token.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Host time the runner spent applying ``SchedulerOutput.grammar`` (ns; the step's
    # structured phase, not its execute phase).
    structured_ns: int = 0
    # Set by the engine core after advancing the matchers: request id -> None when its grammar
    # is complete with the sampled token (it finishes with ``stop``), or the matcher's error
    # (it finishes with ``error``). `Scheduler.update_from_output` applies them.
    structured_ends: dict[str, str | None] = field(default_factory=dict)
    # Speculative decoding: the tokens each row that verified a draft emits, in order (the
    # accepted drafts, then the target's own token: 1 .. k + 1; such a row is not in
    # ``sampled``), and the drafts proposed for each sampled row's next step.
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
