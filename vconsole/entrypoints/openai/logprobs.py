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

The prompt's logprobs (`vconsole.engine.outputs.PromptLogprobs`) come in two shapes too: vLLM's
``prompt_logprobs`` (`vllm_prompt_logprobs`: None for the first position, then per position a
map of token id to ``{"logprob", "rank", "decoded_token"}``, the prompt's token first), and the
legacy block of an ``echo``-ed prompt (`completion_logprobs` with a None entry first: the first
token has no logprob, as OpenAI's legacy API and vLLM return it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vconsole.engine.outputs import PromptLogprobs

Entry = tuple[float, list[int], list[float]]
MIN_LOGPROB = -9999.0    # what JSON gets for -inf (vLLM's and OpenAI's clamp)


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


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int],
                        entries: Sequence[Entry | None], start: int = 0,
                        limit: int | None = None, base_offset: int = 0,
                        top: int | None = None) -> dict[str, Any]:
    """The legacy block for tokens ``start``.. of one output (or an echoed prompt: a None
    entry, its first token's, has no logprob and no top logprobs). ``top``: keep at most that
    many of each entry's top logprobs (the engine may have computed more)."""
    n, offsets = kept(tokenizer, token_ids, start, len(entries), limit)
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for k in range(start, start + n):
        entry = entries[k]
        out["tokens"].append(tokenizer.decode([token_ids[k]]))
        out["text_offset"].append(base_offset + offsets[k - start])
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, ids, lps = entry
        lp = max(lp, MIN_LOGPROB)
        out["token_logprobs"].append(lp)
        cut = slice(None) if top is None else slice(top)
        best = {tokenizer.decode([t]): max(v, MIN_LOGPROB)
                for t, v in zip(ids[cut], lps[cut], strict=True)}
        best.setdefault(out["tokens"][-1], lp)
        out["top_logprobs"].append(best)
    return out


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy blocks as one (an echoed prompt's, then the output's)."""
    return {key: [*first[key], *second[key]] for key in first}


def vllm_prompt_logprobs(tokenizer: Any, prompt_ids: Sequence[int], plp: PromptLogprobs,
                         top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None, then per position the prompt token's entry followed
    by the ``top`` most likely tokens' (ranks 1..top), keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for pos in range(len(plp)):
        token = prompt_ids[pos + 1]
        entry = {str(token): {"logprob": max(plp.token_logprobs[pos], MIN_LOGPROB),
                              "rank": plp.ranks[pos],
                              "decoded_token": tokenizer.decode([token])}}
        for rank, (t, v) in enumerate(zip(plp.top_ids[pos][:top], plp.top_logprobs[pos][:top],
                                          strict=True), start=1):
            entry.setdefault(str(t), {"logprob": max(v, MIN_LOGPROB), "rank": rank,
                                      "decoded_token": tokenizer.decode([t])})
        out.append(entry)
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
