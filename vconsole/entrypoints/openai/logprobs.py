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

The prompt's logprobs (`vconsole.wire.outputs.PromptLogprobs`) come in two shapes too: vLLM's
``prompt_logprobs`` (`vllm_prompt_logprobs`: None for the first position, then per position a
map of token id to ``{"logprob", "rank", "decoded_token"}``, the prompt's token first), and the
legacy block of an ``echo``-ed prompt (`completion_logprobs` with a None entry first: the first
token has no logprob, as OpenAI's legacy API and vLLM return it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vconsole.wire.outputs import PromptLogprobs

Entry = tuple[float, list[int], list[float]]
MIN_LOGPROB = -9999.0    # what JSON gets for -inf (vLLM's and OpenAI's clamp)
CONTEXT_TOKENS = 8    # left context a block of tokens is decoded with (`offsets`)
BLOCK_TOKENS = 16


def offsets(tokenizer: Any, token_ids: Sequence[int], start: int, end: int) -> list[int]:
    """Where tokens ``start``..``end`` begin in the decoding of ``token_ids``: the length of
    the decoded prefix before each (special tokens skipped), in linear time.

    Decoding every prefix is quadratic (8k prompt tokens took seconds). Here only the prefix
    before ``start`` is decoded whole; then, a block of `BLOCK_TOKENS` at a time, each token's
    offset is the block's first plus how much the block's tokens before it lengthen a window
    that starts `CONTEXT_TOKENS` tokens before the block, all windows in one
    ``batch_decode``. How much text tokens add depends only on what comes just before them
    (a UTF-8 character split across tokens reads U+FFFD until it is complete; a leading space
    that a tokenizer strips from the start of a decoding is stripped from every window of the
    block alike), so this is the prefix decoding's length (checked against decoding every
    prefix with the tiny model's byte tokenizer and SmolLM2's byte-level BPE)."""
    if start >= end:
        return []
    ids = list(token_ids)
    first = len(tokenizer.decode(ids[:start], skip_special_tokens=True)) if start else 0
    windows: list[list[int]] = []
    for b in range(start, end - 1, BLOCK_TOKENS):
        lo = max(0, b - CONTEXT_TOKENS)
        windows += [ids[lo:j] for j in range(b, min(b + BLOCK_TOKENS, end - 1) + 1)]
    lens = [len(t) for t in tokenizer.batch_decode(windows, skip_special_tokens=True)]
    out = [first]
    at = 0
    for b in range(start, end - 1, BLOCK_TOKENS):
        num = min(b + BLOCK_TOKENS, end - 1) - b
        base = out[-1] - lens[at]
        out += [base + n for n in lens[at + 1:at + num + 1]]
        at += num + 1
    return out


@dataclass(frozen=True)
class TokenTexts:
    """Tokens ``start``.. of a token list: each one's own decoding and where it begins in the
    list's decoding (`offsets`). An echoed prompt's are computed once and shared by its ``n``
    samples."""

    start: int
    tokens: list[str]
    offsets: list[int]

    @classmethod
    def of(cls, tokenizer: Any, token_ids: Sequence[int], start: int = 0,
           end: int | None = None) -> TokenTexts:
        end = len(token_ids) if end is None else end
        return cls(start, list(tokenizer.batch_decode([[t] for t in token_ids[start:end]])),
                   offsets(tokenizer, token_ids, start, end))


def kept(tokenizer: Any, token_ids: Sequence[int], start: int, end: int,
         limit: int | None) -> tuple[int, list[int]]:
    """How many of tokens ``start``..``end`` start before ``limit``, and their offsets."""
    found = offsets(tokenizer, token_ids, start, end)
    if limit is not None:
        found = [o for o in found if o < limit]
    return len(found), found


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int],
                        entries: Sequence[Entry | None], start: int = 0,
                        limit: int | None = None, base_offset: int = 0,
                        top: int | None = None,
                        texts: TokenTexts | None = None) -> dict[str, Any]:
    """The legacy block for tokens ``start``.. of one output (or an echoed prompt: a None
    entry, its first token's, has no logprob and no top logprobs). ``top``: keep at most that
    many of each entry's top logprobs (the engine may have computed more). ``texts``: the
    tokens' `TokenTexts` from ``start``, when already computed."""
    if texts is None:
        texts = TokenTexts.of(tokenizer, token_ids, start, len(entries))
    assert texts.start == start and len(texts.offsets) == len(entries) - start
    n = len(texts.offsets) if limit is None else sum(o < limit for o in texts.offsets)
    out: dict[str, Any] = {"tokens": texts.tokens[:n], "token_logprobs": [],
                           "top_logprobs": [],
                           "text_offset": [base_offset + o for o in texts.offsets[:n]]}
    pieces: dict[int, str] = {}          # top tokens' texts, each decoded once

    def piece(t: int) -> str:
        if t not in pieces:
            pieces[t] = tokenizer.decode([t])
        return pieces[t]

    cut = slice(None) if top is None else slice(top)
    for k in range(start, start + n):
        entry = entries[k]
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, ids, lps = entry
        lp = max(lp, MIN_LOGPROB)
        out["token_logprobs"].append(lp)
        best = {piece(t): max(v, MIN_LOGPROB) for t, v in zip(ids[cut], lps[cut], strict=True)}
        best.setdefault(texts.tokens[k - start], lp)
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
        return {"token": text, "logprob": max(lp, MIN_LOGPROB), "bytes": list(text.encode())}

    content = []
    for k in range(start, start + n):
        lp, ids, lps = entries[k]
        content.append({**item(token_ids[k], lp),
                        "top_logprobs": [item(t, v) for t, v in zip(ids, lps, strict=True)]})
    return {"content": content}
