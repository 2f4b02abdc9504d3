"""OpenAIServing: what every endpoint of the server shares — the model it serves, the engine
behind it, a request's checks and sampling, and the server-sent events a stream is made of.

`start` (once the event loop runs) does the engine's handshake and loads the tokenizer from
the model directory the engine names. The endpoint classes (`serving_completion`,
`serving_chat`, `serving_tokenization`, `serving_models`) each hold this one object: the
tokenizer, names and limits are filled in once, here, and read by all of them.

A generation request's ``n`` samples of one prompt run through `EngineLink.samples` (`run`);
text and stop strings come from `TextStream` (a stop string is never sent, not even in part;
the request is aborted in the engine when one is hit). A request's structured-output
constraint, from its fields or chat's ``tool_choice``, is checked to compile before anything
reaches the engine (`constraint`) and rides in each sample's sampling arguments
(``structured``).

Streams are server-sent events, ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at
the end, as OpenAI's SDK reads them (`Chunks`). Token accounting follows vLLM (`Usage`):
``prompt_tokens`` counts each prompt once however many samples it has, ``completion_tokens``
every sample's tokens. ``finish_reason``: ``stop`` (EOS, a stop token or a stop string;
``stop_reason`` names the string or token id), ``length``, or ``abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.entrypoints.openai import structured
from vconsole.entrypoints.openai.engine_link import EngineLink, engine_refusal
from vconsole.entrypoints.openai.logprobs import Entry, vllm_prompt_logprobs
from vconsole.entrypoints.openai.protocol import BadRequest, ChatMessage, SamplingFields
from vconsole.entrypoints.openai.request_metrics import RequestSizeMetrics, per_request_timing
from vconsole.entrypoints.openai.text import TextStream
from vconsole.entrypoints.openai.tool_calls import ToolCallStream
from vconsole.entrypoints.openai.tools import ToolPlan, takes_tools, template_messages
from vconsole.entrypoints.openai.tracing import RequestTracer
from vconsole.wire.outputs import PromptLogprobs
from vconsole.wire.sampling import StructuredSpec

DONE = "data: [DONE]\n\n"
# The serving layer's one logger, by the name its log lines have always carried.
log = logging.getLogger("vconsole.entrypoints.openai.serving")


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def stream_error(request_id: str, e: BadRequest) -> str:
    """The error event that ends a stream whose 200 is already sent, and its one log line
    (the access log says 200 for it)."""
    log.warning("%s: stream ended by a %d: %s", request_id, e.status, e)
    return sse(e.body())


def response_id(kind: str, rid: str, given: str | None) -> str:
    """The response's ``id``: ``cmpl-<x-request-id>`` as vLLM, else the engine id."""
    return f"{kind}-{rid}" if given else rid


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
    num_cached_tokens: int = 0                              # the engine's, once finished
    num_preemptions: int = 0
    timings: dict[str, float] | None = None                 # its phases (RequestOutput)
    config_version: int | None = None                       # the engine's, once finished

    @property
    def limit(self) -> int | None:
        """Where a stop string cut the text: tokens from there on are not reported."""
        return len(self.text.text) if self.text.stopped is not None else None

    def logprobs_from(self, stream: bool) -> int:
        """The first of this sample's logprobs to report: 0 for the whole output; with
        ``stream`` the first not yet sent (and all of them count as sent from now on)."""
        if not stream:
            return 0
        start, self.lp_sent = self.lp_sent, len(self.logprobs)
        return start


class OpenAIServing:
    """The served model and its engine; the served name defaults to the engine's ``--model``
    value, as vLLM's does."""

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
        self.tracer: RequestTracer | None = None    # --otlp-traces-endpoint: a span per prompt
        self.request_metrics: RequestSizeMetrics | None = None   # set by the app: /metrics
        self.per_request_metrics = False        # --enable-per-request-metrics

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
        if self.request_metrics is not None:     # its series at zero from the first scrape
            self.request_metrics.prime(self.model_name, self.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.info.get("vocab_size") or len(self.tokenizer))

    def _grammar_tokenizer(self) -> Any:
        """llguidance's view of the model's vocabulary, as the engine builds it (a grammar's
        token ranges and special tokens are checked against it)."""
        from vconsole.engine.structured.compiler import build_tokenizer

        return build_tokenizer(self.tokenizer, self.vocab_size, ())

    # --- a request's checks --------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", param="model", status=404,
                             kind="NotFoundError")

    def check_request(self, req: SamplingFields) -> None:
        """A generation request's model, and what in it this server does not take."""
        self.check_model(req.model)
        req.unsupported()

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

    def max_tokens(self, ids: Sequence[int], requested: int | None) -> int:
        """``max_tokens`` within the context window (vLLM's checks and message)."""
        room = self.max_model_len - len(ids)
        if room <= 0 or (requested is not None and requested > room):
            want = len(ids) + (requested or 0)
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, you requested {want} tokens ({len(ids)} in the "
                             f"messages, {requested or 0} in the completion). Please reduce the "
                             "length of the messages or completion.", param="max_tokens")
        return requested if requested is not None else room

    async def constraint(self, req: SamplingFields,
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

    async def collect(self, rid: str, ids: list[int], req: SamplingFields, limit: int, *,
                      spec: StructuredSpec | None = None,
                      tools: Callable[[], ToolCallStream] | None = None,
                      arrival_ns: int | None = None) -> list[Choice]:
        choices: list[Choice] = []
        async for _ in self.run(rid, ids, req, limit, choices, spec=spec, tools=tools,
                                arrival_ns=arrival_ns):
            pass
        return choices

    async def run(self, rid: str, ids: list[int], req: SamplingFields, limit: int,
                  choices: list[Choice], *, spec: StructuredSpec | None = None,
                  tools: Callable[[], ToolCallStream] | None = None,
                  arrival_ns: int | None = None) -> AsyncIterator[tuple[Choice, str]]:
        """`_run`, in a request span when the server traces (`tracing`): the span starts at the
        request's ``arrival_ns`` (its handler's start, before tokenizing: its latencies count
        from there, as vLLM's), and ends when the samples do, however they end (finished,
        refused, the client gone). Samples that all
        finish are counted in vLLM's request-size histograms (`request_metrics`)."""
        samples = self._run(rid, ids, req, limit, choices, spec=spec, tools=tools)
        span = None if self.tracer is None else self.tracer.start(rid, self.model_name, {
            "max_tokens": limit, "temperature": req.temperature, "top_p": req.top_p,
            "n": req.n}, len(ids), arrival_ns)
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(samples):
                async for c, delta in samples:
                    if span is not None and c.num_tokens:
                        span.first_token()
                    yield c, delta
        except Exception as e:          # a refusal, the engine gone; not a client gone away
            error = e
            raise
        finally:
            if span is not None:
                span.end(sum(c.num_tokens for c in choices),
                         [c.finish_reason for c in choices],
                         num_cached_tokens=max((c.num_cached_tokens for c in choices),
                                               default=0),
                         num_preemptions=sum(c.num_preemptions for c in choices),
                         timings=choices[0].timings if choices else None,
                         config_version=choices[0].config_version if choices else None,
                         error=error)
        if self.request_metrics is not None:     # every sample finished
            self.request_metrics.observe(
                self.model_name, self.max_model_len, num_prompt_tokens=len(ids),
                max_tokens=limit, generation_tokens=[c.num_tokens for c in choices],
                cached_tokens=[c.num_cached_tokens for c in choices])

    async def _run(self, rid: str, ids: list[int], req: SamplingFields, limit: int,
                   choices: list[Choice], *, spec: StructuredSpec | None = None,
                   tools: Callable[[], ToolCallStream] | None = None
                   ) -> AsyncGenerator[tuple[Choice, str], None]:
        """(choice, new text) as the ``n`` samples of one prompt progress; ``choices`` fills
        with them (each with its own tool-call reader from ``tools``). Each sample carries the
        structured-output ``spec``. An engine that refuses the request raises `BadRequest`
        with its reason. ``limit`` 0 (``max_tokens: 0`` with ``echo``): the engine samples one
        token (it always samples one, as vLLM), which is not returned."""
        stops, keep_stop = req.stop_strings(), req.include_stop_str_in_output
        choices[:] = [Choice(i, TextStream(self.tokenizer, stops,
                                           include_stop_str_in_output=keep_stop,
                                           skip_special_tokens=req.skip_special_tokens),
                             tools=tools() if tools else None)
                      for i in range(req.n)]
        sampling = [req.engine_sampling(max(limit, 1), i) for i in range(req.n)]
        if spec is not None:
            for params in sampling:
                params["structured"] = structured.engine_field(spec)
        stopped: set[int] = set()            # hit a stop string: `samples` aborts them
        async for i, out in self.engine.samples(rid, ids, sampling, req.priority,
                                                stopped=stopped):
            c = choices[i]
            if out.finished:
                c.num_cached_tokens, c.num_preemptions = out.num_cached_tokens, \
                    out.num_preemptions
                c.timings, c.config_version = out.timings, out.config_version
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

    def timing_field(self, choices: Sequence[Choice], num_prompts: int = 1) -> dict[str, Any]:
        """``{"metrics": {...}}``, vLLM's per-request timings (`--enable-per-request-metrics`),
        for a request of one prompt and one sample whose engine reported them; else ``{}``."""
        if not self.per_request_metrics or num_prompts != 1 or len(choices) != 1:
            return {}
        c = choices[0]
        return {"metrics": per_request_timing(c.timings or {}, c.num_tokens)}

    def prompt_logprobs_field(self, req: SamplingFields, c: Choice,
                              ids: list[int]) -> dict[str, Any]:
        """``{"prompt_logprobs": [...]}`` in vLLM's shape, when the request asked for it."""
        if req.prompt_logprobs is None or c.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, ids, c.prompt_logprobs,
                                                        req.prompt_logprobs)}


class ServingEndpoint:
    """One endpoint's serving class: it reads and drives the server's one `OpenAIServing`.
    A generation endpoint's ``create(req, request_id)`` takes the client's ``x-request-id``
    as ``request_id`` (the engine's id for the request) and answers one JSON body, or the
    ``stream``'s events."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @staticmethod
    async def stream(request_id: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's body: its chunks, then ``[DONE]``; a `BadRequest` raised once its 200
        is sent (the engine refused a sample) becomes its last event before ``[DONE]``."""
        try:
            async for chunk in chunks:
                yield chunk
        except BadRequest as e:
            yield stream_error(request_id, e)
        yield DONE


class Usage:
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


class Chunks:
    """One stream's SSE chunks: the envelope both APIs share, ``usage`` in every chunk with
    vLLM's ``stream_options.continuous_usage_stats``, and the final usage-only chunk. The
    usage is ``counts`` (what has finished) plus the tokens of the ``running`` choices."""

    def __init__(self, resp_id: str, kind: str, model: str, req: SamplingFields) -> None:
        self.head = {"id": resp_id, "object": kind, "created": int(time.time()), "model": model}
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        self.extra: dict[str, Any] = {}      # added to the final usage chunk (vLLM's metrics)
        self.counts = Usage()
        self.running: list[Choice] = []

    def _usage(self) -> dict[str, int]:
        return self.counts.body(self.running)

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
        return sse({**self.head, "choices": [], "usage": self._usage(), **self.extra})
