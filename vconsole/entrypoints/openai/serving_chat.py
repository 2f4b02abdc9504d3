"""OpenAIServingChat: ``POST /v1/chat/completions``, as vLLM serves it.

The messages become one prompt through the chat template (`OpenAIServing.chat_prompt`, with
the tools the model may call); its ``n`` samples come back as one JSON body, or (``stream``) as
chunks: a first ``role`` delta per choice, then ``content`` deltas, then the finish.

Tools: ``tool_choice`` ``required`` or a named function constrains the output to calls (the
constraint rides in the sampling arguments); ``auto`` reads calls out of free text with the
server's ``--tool-call-parser`` (``hermes``). Each choice then has a `ToolCallStream` that
turns its text into content and ``tool_calls`` (whole, or streamed as OpenAI's deltas);
``finish_reason`` is ``tool_calls`` as vLLM sets it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vconsole.entrypoints.openai.logprobs import chat_logprobs
from vconsole.entrypoints.openai.protocol import ChatCompletionRequest
from vconsole.entrypoints.openai.serving_base import (
    Choice,
    Chunks,
    ServingEndpoint,
    Usage,
    response_id,
)
from vconsole.entrypoints.openai.tool_calls import (
    HermesCalls,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
)
from vconsole.entrypoints.openai.tools import ToolPlan, plan_tools
from vconsole.wire.sampling import StructuredSpec


class OpenAIServingChat(ServingEndpoint):
    async def create(self, req: ChatCompletionRequest, request_id: str | None = None
                     ) -> dict[str, Any] | AsyncIterator[str]:
        arrival_ns = time.time_ns()         # the span's start: before tokenizing, as vLLM's
        serving = self.serving
        serving.check_request(req)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          auto_enabled=serving.tool_call_parser is not None)
        spec = await serving.constraint(req, plan)
        ids = serving.chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  kwargs=req.chat_template_kwargs, tools=plan)
        limit = serving.max_tokens(ids, req.requested_max_tokens())
        serving.engine.check_reachable()    # a stream's 503 too must come before its 200
        rid = serving.engine.new_id("chatcmpl", request_id)
        if req.stream:
            resp_id = response_id("chatcmpl", rid, request_id)
            return self.stream(rid, self._chunks(req, rid, resp_id, ids, limit, spec, plan,
                                                   arrival_ns))
        done = await serving.collect(rid, ids, req, limit, spec=spec, tools=self._parser(plan),
                                     arrival_ns=arrival_ns)
        usage = Usage()
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
        return {"id": response_id("chatcmpl", rid, request_id), "object": "chat.completion",
                "created": int(time.time()),
                "model": serving.model_name, "choices": choices,
                "usage": usage.body(), **serving.prompt_logprobs_field(req, done[0], ids),
                **serving.timing_field(done)}

    async def _chunks(self, req: ChatCompletionRequest, rid: str, resp_id: str,
                      ids: list[int], limit: int, spec: StructuredSpec | None,
                      plan: ToolPlan, arrival_ns: int | None = None) -> AsyncIterator[str]:
        out = Chunks(resp_id, "chat.completion.chunk", self.serving.model_name, req)
        out.counts.prompt_tokens = len(ids)
        # an answer constrained to tool calls has no content: null, as OpenAI sends it
        first = None if plan.choice in ("required", "named") else ""
        for i in range(req.n):
            yield out.chunk(i, None, delta={"role": "assistant", "content": first})
        async for c, delta in self.serving.run(rid, ids, req, limit, out.running, spec=spec,
                                               tools=self._parser(plan),
                                               arrival_ns=arrival_ns):
            if c.tools is not None:
                for chunk in self._tool_chunks(req, out, c, delta, plan):
                    yield chunk
            elif delta or c.finish_reason:
                yield out.chunk(c.index, c, delta={"content": delta} if delta else {},
                                logprobs=self._chat_logprobs(req, c, stream=True))
        out.extra = self.serving.timing_field(out.running)
        if req.include_usage():
            yield out.usage()

    def _tool_chunks(self, req: ChatCompletionRequest, out: Chunks, c: Choice, delta: str,
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
            assert self.serving.tool_call_parser == "hermes"
            parallel = plan.parallel
            return lambda: HermesCalls(parallel)
        return None

    def _chat_logprobs(self, req: ChatCompletionRequest, c: Choice, *,
                       stream: bool = False) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return chat_logprobs(self.serving.tokenizer, c.text.token_ids, c.logprobs,
                             c.logprobs_from(stream), c.limit)


def _tool_finish(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for an output that ended by itself with calls, as vLLM: with
    ``tool_choice`` auto or required (a named function's call ends with ``stop``)."""
    if reason == "stop" and called and plan.choice in ("auto", "required"):
        return "tool_calls"
    return reason
