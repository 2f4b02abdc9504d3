"""What the engine sends back per request: token deltas while it runs, a final message at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# One token's logprobs (as `vconsole.engine.request.TokenLogprobs`): (its logprob, top ids,
# top logprobs).
Logprobs = tuple[float, list[int], list[float]]


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

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by ``later``'s as one output (a consumer that fell behind reads
        what queued up at once, as vLLM's output collector merges deltas)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        return replace(later, new_token_ids=[*self.new_token_ids, *later.new_token_ids],
                       logprobs=logprobs,
                       num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
                       num_cached_tokens=later.num_cached_tokens or self.num_cached_tokens)
