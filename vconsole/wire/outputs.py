"""What the engine sends back per request: token deltas while it runs, a final message at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# One token's logprobs (as `vconsole.engine.request.TokenLogprobs`): (its logprob, top ids,
# top logprobs).
Logprobs = tuple[float, list[int], list[float]]


@dataclass
class PromptLogprobs:
    """A prompt's logprobs, as vLLM's ``prompt_logprobs``, in columns: entry ``i`` is prompt
    position ``i + 1`` (position 0 has no context; vLLM's list starts with None there), from
    the logits of position ``i``: its token's logprob, that token's rank (1 + how many tokens
    are more likely; vLLM counts ties as more likely), and the top-k ids and logprobs.

    Invariant: the four lists are equally long, at most the prompt's length minus 1."""

    token_logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def extend(self, other: PromptLogprobs) -> None:
        """Append the next chunk's positions."""
        self.token_logprobs.extend(other.token_logprobs)
        self.ranks.extend(other.ranks)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)

    def entries(self) -> list[Logprobs | None]:
        """Per prompt position, as output tokens' logprobs read: None first, then (logprob,
        top ids, top logprobs)."""
        return [None, *zip(self.token_logprobs, self.top_ids, self.top_logprobs, strict=True)]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # length / stop / abort / timeout / error
    text: str | None = None           # full detokenized output, on the final message
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None          # why, when finish_reason is "error"
    logprobs: list[Logprobs] | None = None  # one per new token, when the request asked
    # The whole prompt's, once, with the first output token (when the request asked).
    prompt_logprobs: PromptLogprobs | None = None
    # On the final output: the request's phases in seconds on the engine's clock (``queue_s``,
    # ``prefill_s``, ``decode_s``, ``inference_s``; `vconsole.engine.latency`'s definitions),
    # those it reached. What per-request metrics and request traces report.
    timings: dict[str, float] | None = None
    # On the final output of a request the scheduler ran: the engine's config version in force
    # when it finished (`vconsole set` bumps it), so a trace can tell which config served it.
    config_version: int | None = None

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by ``later``'s as one output (a consumer that fell behind reads
        what queued up at once, as vLLM's output collector merges deltas)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        return replace(later, new_token_ids=[*self.new_token_ids, *later.new_token_ids],
                       logprobs=logprobs,
                       prompt_logprobs=(self.prompt_logprobs if self.prompt_logprobs is not None
                                        else later.prompt_logprobs),
                       num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
                       num_cached_tokens=later.num_cached_tokens or self.num_cached_tokens)
