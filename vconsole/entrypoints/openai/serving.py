"""OpenAIServing: completions, chat completions, tokenize and detokenize, as vLLM serves them.

Each handler checks the request (`BadRequest` with the field's name), turns it into prompt
token ids and the engine's sampling arguments, runs every prompt's ``n`` samples through
`EngineLink.samples` and shapes the answer: one JSON body, or (``stream``) server-sent events,
``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end, as OpenAI's SDK reads them.
Text and stop strings come from `TextStream` (a stop string is never sent, not even in part;
the request is aborted in the engine when one is hit).

Prompt logprobs (``prompt_logprobs``, and ``echo`` with ``logprobs``) come from the engine with
a sample's first output; ``max_tokens: 0`` with ``echo`` runs the engine for one token (it
always samples one, as vLLM) and returns none of it: the prompt, its logprobs, no completion
tokens.

Structured output (`structured`): the request's one constraint, from its fields or chat's
``tool_choice`` (`tools`), is checked to compile before anything reaches the engine and rides in
each sample's sampling arguments (``structured``). A chat request whose output holds tool calls
gives each choice a `ToolCallStream` that turns its text into content and ``tool_calls`` (whole,
or streamed as OpenAI's deltas); ``finish_reason`` is then ``tool_calls`` as vLLM sets it.

Token accounting follows vLLM: ``prompt_tokens`` counts each prompt once however many samples it
has, ``completion_tokens`` every sample's tokens. ``finish_reason``: ``stop`` (EOS, a stop token
or a stop string; ``stop_reason`` names the string or token id), ``length``, or ``abort``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.outputs import PromptLogprobs
from vconsole.engine.request import StructuredSpec
from vconsole.entrypoints.openai import structured
from vconsole.entrypoints.openai.engine_link import EngineLink, engine_refusal
from vconsole.entrypoints.openai.logprobs import (
    Entry,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from vconsole.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from vconsole.entrypoints.openai.text import TextStream
from vconsole.entrypoints.openai.tool_calls import (
    HermesCalls,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
)
from vconsole.entrypoints.openai.tools import ToolPlan, plan_tools, takes_tools, template_messages

DONE = "data: [DONE]\n\n"
log = logging.getLogger(__name__)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def stream_error(request_id: str, e: BadRequest) -> str:
    """The error event that ends a stream whose 200 is already sent, and its one log line
    (the access log says 200 for it)."""
    log.warning("%s: stream ended by a %d: %s", request_id, e.status, e)
    return sse(e.body())


@dataclass
class Choice:
    """One sample's progress: its text stream and how it ended."""

    index: int
    text: TextStream
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Entry] = field(default_factory=list)   # one per token, when asked
    lp_sent: int = 0                                        # of them, streamed so far
    prompt_logprobs: PromptLogprobs | None = None           # the prompt's, when asked
    tools: ToolCallStream | None = None                     # its tool calls, when parsed

    @property
    def limit(self) -> int | None:
        """Where a stop string cut the text: tokens from there on are not reported."""
        return len(self.text.text) if self.text.stopped is not None else None


class OpenAIServing:
    """`start` (once the event loop runs) does the engine's handshake and loads the tokenizer
    from the model directory the engine names; the served name defaults to the engine's
    ``--model`` value, as vLLM's does."""

    def __init__(self, engine: EngineLink, *, model_name: str | None = None,
                 chat_template: str | None = None, tokenizer: Any = None,
                 tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: what reads ``tool_choice: "auto"``'s calls out of the text
        (``hermes``); None (no ``--enable-auto-tool-choice``): auto is refused."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name or ""
        self.max_model_len = 0
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        self._takes_tools: dict[str, bool] = {}     # per template: it renders tools itself
        self._spec_checker = structured.SpecChecker(self._grammar_tokenizer)

    async def start(self) -> None:
        """The engine's ``ready`` (`TimeoutError` when none answers), then the tokenizer."""
        await self.engine.connect()
        info = self.engine.info
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, info["model_path"], local_files_only=True)
        self.model_name = self.model_name or str(info.get("model") or info["model_path"])
        self.max_model_len = int(info["max_model_len"])
        self.chat_template = self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def _grammar_tokenizer(self) -> Any:
        """llguidance's view of the model's vocabulary, as the engine builds it (a grammar's
        token ranges and special tokens are checked against it)."""
        from vconsole.engine.structured.compiler import build_tokenizer

        vocab = int(self.engine.info.get("vocab_size") or len(self.tokenizer))
        return build_tokenizer(self.tokenizer, vocab, ())

    # --- models, tokens ------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "vconsole", "root": self.engine.info.get("model_path", self.model_name),
            "parent": None, "max_model_len": self.max_model_len,
            "vocab_size": self.engine.info.get("vocab_size")}]}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", param="model", status=404,
                             kind="NotFoundError")

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        req.refuse_unknown()
        for i, message in enumerate(req.messages or ()):
            message.refuse_unknown(f"messages.{i}.")
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of prompt or messages", param="prompt")
        if req.tools and req.messages is None:
            raise BadRequest("tools are rendered into a chat prompt: send messages with them",
                             param="tools")
        if req.messages is not None:
            # The functions shown as a chat request with these tools shows them.
            plan = plan_tools(req.tools, "required" if req.tools else None, None,
                              auto_enabled=True)
            ids = self.chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                   tools=plan)
        else:
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len,
                               "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        req.refuse_unknown()
        vocab = int(self.engine.info.get("vocab_size") or len(self.tokenizer))
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def chat_prompt(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    kwargs: dict[str, Any] | None = None,
                    tools: ToolPlan | None = None) -> list[int]:
        """The chat template's rendering, tokenized as it is: no BOS or other special token
        that the template does not write itself. The tools the model may call, and the
        history's calls and results, as `template_messages` renders them for this template."""
        if not self.chat_template:
            raise BadRequest("this model has no chat template: start the server with "
                             "--chat-template FILE, or use /v1/completions", param="messages")
        template = self.chat_template
        if template not in self._takes_tools:
            self._takes_tools[template] = takes_tools(template)
        convo, tool_list = template_messages([m.template_dict() for m in messages],
                                             tools.shown() if tools else [],
                                             self._takes_tools[template])
        extra = dict(kwargs or {})
        if tool_list is not None:
            extra["tools"] = tool_list
        try:
            text = self.tokenizer.apply_chat_template(
                convo, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **extra)
        except Exception as e:  # a template that raises on these messages (jinja errors)
            raise BadRequest(f"the chat template failed on these messages: {e}",
                             param="messages") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    # --- completions ---------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, request_id: str | None = None
                          ) -> dict[str, Any] | AsyncIterator[str]:
        """``request_id``: the client's ``x-request-id``, the engine's id for the request."""
        self.check_model(req.model)
        req.unsupported()
        spec = await self._constraint(req)
        prompts: list[tuple[str | None, list[int]]] = []      # (text or None, token ids)
        for prompt in req.prompts():
            if isinstance(prompt, str):
                prompts.append((prompt, list(self.tokenizer(prompt).input_ids)))
            else:
                prompts.append((None, self._check_ids(prompt)))
        max_tokens = [self._max_tokens(ids, req.max_tokens) for _, ids in prompts]
        self.engine.check_reachable()       # a stream's 503 too must come before its 200
        rid = self.engine.new_id("cmpl", request_id)
        if req.stream:
            return self._stream_completion(req, rid, _response_id("cmpl", rid, request_id),
                                           prompts, max_tokens, spec)
        choices: list[dict[str, Any]] = []
        usage = _Usage()
        for p, ((text, ids), limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            echo = (text if text is not None else self.tokenizer.decode(ids)) if req.echo else ""
            done = await self._collect(_prompt_id(rid, p, len(prompts)), ids, req, limit,
                                       spec=spec)
            usage.add(len(ids), done)
            texts = self._prompt_texts(req, ids, echo)      # shared by the n samples
            choices += [{"index": p * req.n + c.index, "text": echo + c.text.text,
                         "logprobs": self._echo_logprobs(req, c, ids, echo, texts),
                         "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason,
                         **self._prompt_logprobs_field(req, c, ids)} for c in done]
        return {"id": _response_id("cmpl", rid, request_id), "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    async def _stream_completion(self, req: CompletionRequest, rid: str, resp_id: str,
                                 prompts: list[tuple[str | None, list[int]]],
                                 max_tokens: list[int],
                                 spec: StructuredSpec | None) -> AsyncIterator[str]:
        usage = _Usage()
        choices: list[Choice] = []
        out = _Chunks(resp_id, "text_completion", self.model_name, req,
                      lambda: usage.body(choices))

        try:
            for p, ((text, ids), limit) in enumerate(zip(prompts, max_tokens, strict=True)):
                usage.prompt_tokens += len(ids)
                echo = (text if text is not None else self.tokenizer.decode(ids)) \
                    if req.echo else ""
                # The echo's logprobs come with each sample's first output: wait for it.
                echo_later = set(range(req.n)) if echo and req.logprobs is not None else set()
                texts = self._prompt_texts(req, ids, echo)  # shared by the n samples
                if echo and not echo_later:
                    for i in range(req.n):
                        yield out.chunk(p * req.n + i, None, text=echo)
                async for c, delta in self._run(_prompt_id(rid, p, len(prompts)), ids, req,
                                                limit, choices, spec=spec):
                    if c.index in echo_later:
                        echo_later.discard(c.index)
                        yield out.chunk(p * req.n + c.index, None, text=echo, logprobs=(
                            self._echo_logprobs(req, c, ids, echo, texts, output=False)))
                    if delta or c.finish_reason:
                        # Output tokens' offsets count from the start of the choice's text,
                        # the echoed prompt included (as the non-streamed block).
                        yield out.chunk(p * req.n + c.index, c, text=delta, logprobs=(
                            self._completion_logprobs(req, c, len(echo), stream=True)))
                usage.add(0, choices)
                choices = []
            if req.include_usage():
                yield out.usage()
        except BadRequest as e:
            yield stream_error(rid, e)
        yield DONE

    # --- chat ----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request_id: str | None = None
                   ) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        req.unsupported()
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          auto_enabled=self.tool_call_parser is not None)
        spec = await self._constraint(req, plan)
        ids = self.chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               kwargs=req.chat_template_kwargs, tools=plan)
        limit = self._max_tokens(ids, req.requested_max_tokens())
        self.engine.check_reachable()       # a stream's 503 too must come before its 200
        rid = self.engine.new_id("chatcmpl", request_id)
        if req.stream:
            return self._stream_chat(req, rid, _response_id("chatcmpl", rid, request_id), ids,
                                     limit, spec, plan)
        done = await self._collect(rid, ids, req, limit, spec=spec, tools=self._parser(plan))
        usage = _Usage()
        usage.add(len(ids), done)
        choices = []
        for c in done:
            message: dict[str, Any] = {"role": "assistant", "content": c.text.text}
            if c.tools is not None:
                c.tools.feed(c.text.text)
                c.tools.finish()
                message["content"], calls = c.tools.result()
                if calls:
                    message["tool_calls"] = calls
                c.finish_reason = _tool_finish(plan, c.finish_reason, bool(calls))
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(req, c),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": _response_id("chatcmpl", rid, request_id), "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage.body(), **self._prompt_logprobs_field(req, done[0], ids)}

    async def _stream_chat(self, req: ChatCompletionRequest, rid: str, resp_id: str,
                           ids: list[int], limit: int, spec: StructuredSpec | None,
                           plan: ToolPlan) -> AsyncIterator[str]:
        usage = _Usage()
        usage.prompt_tokens = len(ids)
        choices: list[Choice] = []
        out = _Chunks(resp_id, "chat.completion.chunk", self.model_name, req,
                      lambda: usage.body(choices))
        try:
            # an answer constrained to tool calls has no content: null, as OpenAI sends it
            first = None if plan.choice in ("required", "named") else ""
            for i in range(req.n):
                yield out.chunk(i, None, delta={"role": "assistant", "content": first})
            async for c, delta in self._run(rid, ids, req, limit, choices, spec=spec,
                                            tools=self._parser(plan)):
                if c.tools is not None:
                    for chunk in self._tool_chunks(req, out, c, delta, plan):
                        yield chunk
                elif delta or c.finish_reason:
                    yield out.chunk(c.index, c, delta={"content": delta} if delta else {},
                                    logprobs=self._chat_logprobs(req, c, stream=True))
            if req.include_usage():
                yield out.usage()
        except BadRequest as e:
            yield stream_error(rid, e)
        yield DONE

    def _tool_chunks(self, req: ChatCompletionRequest, out: _Chunks, c: Choice, delta: str,
                     plan: ToolPlan) -> list[str]:
        """A tool-parsed choice's chunks for its new text: content and ``tool_calls`` deltas
        in order (the logprobs so far on the first), then the finish alone."""
        assert c.tools is not None
        events = c.tools.feed(delta) if delta else []
        if c.finish_reason:
            events += c.tools.finish()
        if not events and not c.finish_reason:
            return []
        logprobs = self._chat_logprobs(req, c, stream=True)
        chunks = []
        for kind, value in events:
            chunks.append(out.chunk(c.index, None, logprobs=logprobs, delta={
                "content": value} if kind == "content" else {"tool_calls": value}))
            logprobs = None
        if c.finish_reason:
            c.finish_reason = _tool_finish(plan, c.finish_reason, bool(c.tools.calls))
            chunks.append(out.chunk(c.index, c, delta={}, logprobs=logprobs))
        return chunks

    def _parser(self, plan: ToolPlan) -> Callable[[], ToolCallStream] | None:
        """What reads each choice's tool calls (None: the text is the answer)."""
        if plan.named is not None:
            name = plan.named.name
            return lambda: NamedCall(name)
        if plan.choice == "required":
            return RequiredCalls
        if plan.choice == "auto":
            assert self.tool_call_parser == "hermes"
            parallel = plan.parallel
            return lambda: HermesCalls(parallel)
        return None

    async def _constraint(self, req: SamplingFields,
                          plan: ToolPlan | None = None) -> StructuredSpec | None:
        """The request's one structured-output constraint (its fields, or its tool choice),
        checked to compile (off the event loop: a large schema takes milliseconds)."""
        asked = [a for a in [structured.spec_of(req.structured_fields())] if a is not None]
        tool_spec = plan.spec() if plan is not None else None
        if tool_spec is not None:
            asked.append(("tool_choice", tool_spec))
        one = structured.only_one(asked)
        if one is None:
            return None
        field, spec = one
        if req.ignore_eos:
            raise BadRequest(f"ignore_eos: a constrained output ({field}) ends where its "
                             "grammar does; it cannot be combined with ignore_eos",
                             param="ignore_eos")
        if req.min_tokens:      # the engine's rule: EOS banned where the grammar may end
            raise BadRequest(f"min_tokens: a constrained output ({field}) ends where its "
                             "grammar does; it cannot be combined with min_tokens",
                             param="min_tokens")
        await asyncio.to_thread(self._spec_checker.check,
                                "tools" if field == "tool_choice" else field, spec)
        return spec

    # --- one prompt's samples ------------------------------------------------------------------

    async def _collect(self, rid: str, ids: list[int], req: SamplingFields, limit: int, *,
                       spec: StructuredSpec | None = None,
                       tools: Callable[[], ToolCallStream] | None = None) -> list[Choice]:
        choices: list[Choice] = []
        async for _ in self._run(rid, ids, req, limit, choices, spec=spec, tools=tools):
            pass
        return choices

    async def _run(self, rid: str, ids: list[int], req: SamplingFields, limit: int,
                   choices: list[Choice], *, spec: StructuredSpec | None = None,
                   tools: Callable[[], ToolCallStream] | None = None
                   ) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) as the ``n`` samples of one prompt progress; ``choices`` fills
        with them (each with its own tool-call reader from ``tools``). Each sample carries the
        structured-output ``spec``. An engine that refuses the request raises `BadRequest`
        with its reason."""
        stops = req.stop_strings()
        choices[:] = [Choice(i, TextStream(self.tokenizer, stops,
                                           include_stop_str_in_output=req.include_stop_str_in_output,
                                           skip_special_tokens=req.skip_special_tokens),
                             tools=tools() if tools else None)
                      for i in range(req.n)]
        # ``limit`` 0 (echo only): the engine samples one token, which is not returned.
        sampling = [req.engine_sampling(max(limit, 1), i) for i in range(req.n)]
        if spec is not None:
            for params in sampling:
                params["structured"] = structured.engine_field(spec)
        stopped: set[int] = set()            # hit a stop string: `samples` aborts them
        async for i, out in self.engine.samples(rid, ids, sampling, req.priority,
                                                stopped=stopped):
            c = choices[i]
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if limit == 0:
                if out.finished:
                    if out.finish_reason == "error":
                        raise engine_refusal(out.error or "the engine refused the request")
                    c.finish_reason = "abort" if out.finish_reason in ("abort", "timeout") \
                        else "length"
                yield c, ""
                continue
            delta = c.text.add(out.new_token_ids)
            c.num_tokens += len(out.new_token_ids)
            if out.logprobs:
                c.logprobs.extend(out.logprobs)
            if c.text.stopped is not None:
                c.finish_reason, c.stop_reason = "stop", c.text.stopped
                stopped.add(i)
            elif out.finished:
                if out.finish_reason == "error":
                    raise engine_refusal(out.error or "the engine refused the request")
                delta += c.text.finish()
                c.finish_reason = "abort" if out.finish_reason in ("abort", "timeout") \
                    else out.finish_reason or "stop"
                last = c.text.token_ids[-1] if c.text.token_ids else None
                if c.finish_reason == "stop" and req.stop_token_ids and last in \
                        req.stop_token_ids:
                    c.stop_reason = last
            yield c, delta

    def _completion_logprobs(self, req: CompletionRequest, c: Choice, base_offset: int, *,
                             stream: bool = False) -> dict[str, Any] | None:
        """The legacy logprobs block: the whole output, or (``stream``) the tokens since the
        last chunk."""
        if req.logprobs is None:
            return None
        start = c.lp_sent if stream else 0
        c.lp_sent = len(c.logprobs) if stream else c.lp_sent
        return completion_logprobs(self.tokenizer, c.text.token_ids, c.logprobs, start,
                                   c.limit, base_offset)

    def _prompt_texts(self, req: CompletionRequest, ids: list[int],
                      echo: str) -> TokenTexts | None:
        """The echoed prompt's token texts and offsets, when its logprobs are returned."""
        if not echo or req.logprobs is None:
            return None
        return TokenTexts.of(self.tokenizer, ids)

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
        block = completion_logprobs(self.tokenizer, ids, entries, top=req.logprobs, texts=texts)
        if not output or req.echo_only:
            return block
        rest = self._completion_logprobs(req, c, len(echo))
        assert rest is not None
        return joined(block, rest)

    def _prompt_logprobs_field(self, req: SamplingFields, c: Choice,
                               ids: list[int]) -> dict[str, Any]:
        """``{"prompt_logprobs": [...]}`` in vLLM's shape, when the request asked for it."""
        if req.prompt_logprobs is None or c.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, ids, c.prompt_logprobs,
                                                        req.prompt_logprobs)}

    def _chat_logprobs(self, req: ChatCompletionRequest, c: Choice, *,
                       stream: bool = False) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        start = c.lp_sent if stream else 0
        c.lp_sent = len(c.logprobs) if stream else c.lp_sent
        return chat_logprobs(self.tokenizer, c.text.token_ids, c.logprobs, start, c.limit)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = int(self.engine.info.get("vocab_size") or len(self.tokenizer))
        if not ids:
            raise BadRequest("prompt must not be empty", param="prompt")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of vocabulary [0, {vocab})",
                             param="prompt")
        return list(ids)

    def _max_tokens(self, ids: Sequence[int], requested: int | None) -> int:
        """``max_tokens`` within the context window (vLLM's checks and message)."""
        room = self.max_model_len - len(ids)
        if room <= 0 or (requested is not None and requested > room):
            want = len(ids) + (requested or 0)
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, you requested {want} tokens ({len(ids)} in the "
                             f"messages, {requested or 0} in the completion). Please reduce the "
                             "length of the messages or completion.", param="max_tokens")
        return requested if requested is not None else room


def _tool_finish(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for an output that ended by itself with calls, as vLLM: with
    ``tool_choice`` auto or required (a named function's call ends with ``stop``)."""
    if reason == "stop" and called and plan.choice in ("auto", "required"):
        return "tool_calls"
    return reason


def _prompt_id(rid: str, p: int, num_prompts: int) -> str:
    """The engine id of prompt ``p`` of a completion request (``rid`` itself for one)."""
    return rid if num_prompts == 1 else f"{rid}-{p}"


def _response_id(kind: str, rid: str, given: str | None) -> str:
    """The response's ``id``: ``cmpl-<x-request-id>`` as vLLM, else the engine id."""
    return f"{kind}-{rid}" if given else rid


class _Usage:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, prompt_tokens: int, choices: Sequence[Choice]) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += sum(c.num_tokens for c in choices)

    def body(self, running: Sequence[Choice] = ()) -> dict[str, int]:
        """The counts, with the tokens of ``running`` choices (not yet added) on top."""
        completion = self.completion_tokens + sum(c.num_tokens for c in running)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


class _Chunks:
    """One stream's SSE chunks: the envelope both APIs share, ``usage`` in every chunk with
    vLLM's ``stream_options.continuous_usage_stats``, and the final usage-only chunk."""

    def __init__(self, resp_id: str, kind: str, model: str, req: SamplingFields,
                 usage: Callable[[], dict[str, int]]) -> None:
        self.head = {"id": resp_id, "object": kind, "created": int(time.time()), "model": model}
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        self._usage = usage

    def chunk(self, index: int, choice: Choice | None, *,
              logprobs: dict[str, Any] | None = None, **content: Any) -> str:
        """``content``: ``text=`` (completions) or ``delta=`` (chat)."""
        body: dict[str, Any] = {**self.head, "choices": [{
            "index": index, **content, "logprobs": logprobs,
            "finish_reason": choice.finish_reason if choice else None,
            "stop_reason": choice.stop_reason if choice else None}]}
        if self.continuous:
            body["usage"] = self._usage()
        return sse(body)

    def usage(self) -> str:
        return sse({**self.head, "choices": [], "usage": self._usage()})
