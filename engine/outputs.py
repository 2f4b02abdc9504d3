"""What the engine sends back per request: token deltas while it runs, a final message at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

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
