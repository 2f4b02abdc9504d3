"""OpenAIServingCompletion: ``POST /v1/completions``, as vLLM serves it.

A request's prompts (text, or token ids checked against the vocabulary) each run their ``n``
samples one prompt after another; the answer is one JSON body, or (``stream``) its chunks as
they come (`OpenAIServing.run`). A choice's ``index`` is ``prompt * n + sample``.

``echo`` puts the prompt before each choice's text. Prompt logprobs (``prompt_logprobs``, and
``echo`` with ``logprobs``) come from the engine with a sample's first output, so a stream
sends an echo with logprobs once that output is in; ``max_tokens: 0`` with ``echo`` runs the
engine for one token and returns none of it: the prompt, its logprobs, no completion tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vconsole.entrypoints.openai.logprobs import TokenTexts, completion_logprobs, joined
from vconsole.entrypoints.openai.protocol import BadRequest, CompletionRequest
from vconsole.entrypoints.openai.serving_base import (
    Choice,
    Chunks,
    ServingEndpoint,
    Usage,
    response_id,
)
from vconsole.wire.sampling import StructuredSpec

Prompt = tuple[str | None, list[int]]       # (its text, or None for token ids; its token ids)


class OpenAIServingCompletion(ServingEndpoint):
    async def create(self, req: CompletionRequest, request_id: str | None = None
                     ) -> dict[str, Any] | AsyncIterator[str]:
        arrival_ns = time.time_ns()         # the spans' start: before tokenizing, as vLLM's
        serving = self.serving
        serving.check_request(req)
        spec = await serving.constraint(req)
        prompts: list[Prompt] = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                prompts.append((prompt, list(serving.tokenizer(prompt).input_ids)))
            else:
                prompts.append((None, self._check_ids(prompt)))
        max_tokens = [serving.max_tokens(ids, req.max_tokens) for _, ids in prompts]
        serving.engine.check_reachable()    # a stream's 503 too must come before its 200
        rid = serving.engine.new_id("cmpl", request_id)
        if req.stream:
            resp_id = response_id("cmpl", rid, request_id)
            return self.stream(rid, self._chunks(req, rid, resp_id, prompts, max_tokens, spec,
                                                   arrival_ns))
        choices: list[dict[str, Any]] = []
        usage = Usage()
        for p, ((text, ids), limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            echo = self._echo(req, text, ids)
            done = await serving.collect(_prompt_id(rid, p, len(prompts)), ids, req, limit,
                                         spec=spec, arrival_ns=arrival_ns)
            usage.add(len(ids), done)
            texts = self._prompt_texts(req, ids, echo)      # shared by the n samples
            choices += [{"index": p * req.n + c.index, "text": echo + c.text.text,
                         "logprobs": self._echo_logprobs(req, c, ids, echo, texts),
                         "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason,
                         **serving.prompt_logprobs_field(req, c, ids)} for c in done]
        return {"id": response_id("cmpl", rid, request_id), "object": "text_completion",
                "created": int(time.time()),
                "model": serving.model_name, "choices": choices, "usage": usage.body(),
                **serving.timing_field(done, len(prompts))}

    async def _chunks(self, req: CompletionRequest, rid: str, resp_id: str,
                      prompts: list[Prompt], max_tokens: list[int],
                      spec: StructuredSpec | None, arrival_ns: int | None = None
                      ) -> AsyncIterator[str]:
        out = Chunks(resp_id, "text_completion", self.serving.model_name, req)
        for p, ((text, ids), limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            out.counts.prompt_tokens += len(ids)
            echo = self._echo(req, text, ids)
            # The echo's logprobs come with each sample's first output: wait for it.
            echo_later = set(range(req.n)) if echo and req.logprobs is not None else set()
            texts = self._prompt_texts(req, ids, echo)  # shared by the n samples
            if echo and not echo_later:
                for i in range(req.n):
                    yield out.chunk(p * req.n + i, None, text=echo)
            async for c, delta in self.serving.run(_prompt_id(rid, p, len(prompts)), ids,
                                                   req, limit, out.running, spec=spec,
                                                   arrival_ns=arrival_ns):
                if c.index in echo_later:
                    echo_later.discard(c.index)
                    yield out.chunk(p * req.n + c.index, None, text=echo, logprobs=(
                        self._echo_logprobs(req, c, ids, echo, texts, output=False)))
                if delta or c.finish_reason:
                    # Output tokens' offsets count from the start of the choice's text,
                    # the echoed prompt included (as the non-streamed block).
                    yield out.chunk(p * req.n + c.index, c, text=delta, logprobs=(
                        self._completion_logprobs(req, c, len(echo), stream=True)))
            out.counts.add(0, out.running)
            out.extra = self.serving.timing_field(out.running, len(prompts))
            out.running = []
        if req.include_usage():
            yield out.usage()

    def _echo(self, req: CompletionRequest, text: str | None, ids: list[int]) -> str:
        """What ``echo`` puts before each choice's text: the prompt, as sent or decoded."""
        if not req.echo:
            return ""
        return text if text is not None else self.serving.tokenizer.decode(ids)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self.serving.vocab_size
        if not ids:
            raise BadRequest("prompt must not be empty", param="prompt")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of vocabulary [0, {vocab})",
                             param="prompt")
        return list(ids)

    def _completion_logprobs(self, req: CompletionRequest, c: Choice, base_offset: int, *,
                             stream: bool = False) -> dict[str, Any] | None:
        """The legacy logprobs block: the whole output, or (``stream``) the tokens since the
        last chunk."""
        if req.logprobs is None:
            return None
        return completion_logprobs(self.serving.tokenizer, c.text.token_ids, c.logprobs,
                                   c.logprobs_from(stream), c.limit, base_offset)

    def _prompt_texts(self, req: CompletionRequest, ids: list[int],
                      echo: str) -> TokenTexts | None:
        """The echoed prompt's token texts and offsets, when its logprobs are returned."""
        if not echo or req.logprobs is None:
            return None
        return TokenTexts.of(self.serving.tokenizer, ids)

    def _echo_logprobs(self, req: CompletionRequest, c: Choice, ids: list[int], echo: str,
                       texts: TokenTexts | None, *,
                       output: bool = True) -> dict[str, Any] | None:
        """The legacy block of a whole choice: with ``echo`` the prompt's tokens first (the
        first without a logprob; ``texts`` their `TokenTexts`), then the output's (unless not
        ``output``)."""
        if req.logprobs is None:
            return None
        if not echo:
            return self._completion_logprobs(req, c, 0)
        # A sample that ended before its first token (aborted, timed out) has none: nulls.
        entries = (c.prompt_logprobs.entries() if c.prompt_logprobs is not None
                   else [None] * len(ids))
        block = completion_logprobs(self.serving.tokenizer, ids, entries, top=req.logprobs,
                                    texts=texts)
        if not output or req.echo_only:
            return block
        rest = self._completion_logprobs(req, c, len(echo))
        assert rest is not None
        return joined(block, rest)


def _prompt_id(rid: str, p: int, num_prompts: int) -> str:
    """The engine id of prompt ``p`` of a completion request (``rid`` itself for one)."""
    return rid if num_prompts == 1 else f"{rid}-{p}"
