"""The runner's own copy of the requests it serves, kept in step with the scheduler's plain data.

The scheduler sends a request whole once (`NewRequestData`) and then only what changed
(`CachedRequestData`); `RequestStates.apply` applies one `SchedulerOutput` and returns the
step's sequences in the scheduler's order. No torch here, so the scheduler's tests drive the very
same bookkeeping without a model.

Invariants: a request is held from its `NewRequestData` until it is listed in
``finished_req_ids`` or ``preempted_req_ids``; forgetting is applied before anything new, so an
id that is forgotten and sent again in one output starts afresh. A held request's ``token_ids``
and ``block_ids`` only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vconsole.engine.sched.output import SchedulerOutput
from vconsole.wire.outputs import PromptLogprobs
from vconsole.wire.sampling import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps for one request between steps."""

    req_id: str
    token_ids: list[int]          # prompt + every output token the scheduler has sent
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]          # the block table: position p lives in block_ids[p // B]
    num_computed_tokens: int      # where this step's tokens start
    # The prompt's logprobs so far, while they are being computed (chunk by chunk); None when
    # not asked or once handed over.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: feed ``num_tokens`` tokens from ``start_pos``;
    ``do_sample`` when that reaches the request's last token."""

    state: CachedRequestState
    start_pos: int
    num_tokens: int
    do_sample: bool
    # Speculative decoding: the drafted tokens fed after the request's last token (then
    # ``num_tokens`` is 1 + their number and every position is sampled); empty otherwise.
    draft: list[int] = field(default_factory=list)

    @property
    def req_id(self) -> str:
        return self.state.req_id

    @property
    def token_ids(self) -> list[int]:
        if self.draft:
            return self.state.token_ids[self.start_pos:] + self.draft
        return self.state.token_ids[self.start_pos:self.start_pos + self.num_tokens]

    @property
    def block_ids(self) -> list[int]:
        return self.state.block_ids


class RequestStates(dict[str, CachedRequestState]):
    """Request id -> `CachedRequestState`, advanced one `SchedulerOutput` at a time."""

    def apply(self, so: SchedulerOutput) -> list[ScheduledSeq]:
        for rid in so.finished_req_ids:
            self.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.pop(rid, None)
        for new in so.scheduled_new_reqs:
            prompt_lps = None
            if new.sampling.prompt_logprobs is not None and not new.output_token_ids:
                if new.num_computed_tokens:
                    raise RuntimeError(f"request {new.req_id!r} asks for prompt logprobs but "
                                       "starts past position 0 (a prefix-cache hit)")
                prompt_lps = PromptLogprobs()
            self[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids), new.sampling, list(new.block_ids),
                new.num_computed_tokens, prompt_lps)
        cached = so.scheduled_cached_reqs
        for rid, tokens, blocks, start in zip(cached.req_ids, cached.new_token_ids,
                                              cached.new_block_ids, cached.num_computed_tokens,
                                              strict=True):
            state = self.get(rid)
            if state is None:
                raise RuntimeError(f"the scheduler sent changes for request {rid!r}, which the "
                                   "runner does not hold")
            state.token_ids.extend(tokens)
            state.block_ids.extend(blocks)
            state.num_computed_tokens = start
        seqs: list[ScheduledSeq] = []
        drafts = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            state = self[rid]
            start = state.num_computed_tokens
            draft = drafts.get(rid) if drafts else None
            if draft:
                if start + 1 != len(state.token_ids) or n != 1 + len(draft):
                    raise RuntimeError(f"request {rid!r}: a draft of {len(draft)} tokens on a "
                                       f"row of {n} from position {start} of "
                                       f"{len(state.token_ids)} tokens (not a decode row)")
                seqs.append(ScheduledSeq(state, start, n, True, list(draft)))
            else:
                seqs.append(ScheduledSeq(state, start, n, start + n == len(state.token_ids)))
        return seqs
