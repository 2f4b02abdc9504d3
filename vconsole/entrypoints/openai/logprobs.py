"""Token logprobs from the engine, in the two shapes OpenAI's API has.

The engine sends, per output token, ``(logprob, top ids, top logprobs)`` computed in its batched
sampler from the raw logits (`vconsole.engine.worker.sampler.Sampler.logprobs`). Here they get
their text:

- completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` a map of token text to logprob that also holds the sampled token (as vLLM);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}``.

A token's text is its own decoding (a token that is part of a UTF-8 character reads U+FFFD, as
in vLLM); ``text_offset`` is where the token's text starts in the completion's text. Tokens that
start at or beyond ``limit`` (the text's end when a stop string cut it) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Entry = tuple[float, list[int], list[float]]


def _offsets(tokenizer: Any, token_ids: Sequence[int], start: int, end: int) -> list[int]:
    """Where tokens ``start``..``end`` begin in the decoding of ``token_ids``."""
    return [len(tokenizer.decode(token_ids[:k], skip_special_tokens=True))
            for k in range(start, end)]


def kept(tokenizer: Any, token_ids: Sequence[int], start: int, end: int,
         limit: int | None) -> tuple[int, list[int]]:
    """How many of tokens ``start``..``end`` start before ``limit``, and their offsets."""
    offsets = _offsets(tokenizer, token_ids, start, end)
    if limit is not None:
        offsets = [o for o in offsets if o < limit]
    return len(offsets), offsets


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry],
                        start: int = 0, limit: int | None = None,
                        base_offset: int = 0) -> dict[str, Any]:
    """The legacy block for tokens ``start``.. of one output."""
    n, offsets = kept(tokenizer, token_ids, start, len(entries), limit)
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for k in range(start, start + n):
        lp, ids, lps = entries[k]
        out["tokens"].append(tokenizer.decode([token_ids[k]]))
        out["token_logprobs"].append(lp)
        top = {tokenizer.decode([t]): v for t, v in zip(ids, lps, strict=True)}
        top.setdefault(out["tokens"][-1], lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(base_offset + offsets[k - start])
    return out


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry],
                  start: int = 0, limit: int | None = None) -> dict[str, Any]:
    """The chat block for tokens ``start``.. of one output."""
    n, _ = kept(tokenizer, token_ids, start, len(entries), limit)

    def item(token: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for k in range(start, start + n):
        lp, ids, lps = entries[k]
        content.append({**item(token_ids[k], lp),
                        "top_logprobs": [item(t, v) for t, v in zip(ids, lps, strict=True)]})
    return {"content": content}
