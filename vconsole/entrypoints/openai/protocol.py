"""The OpenAI API's request bodies, as vLLM's server accepts them, and their mapping to the engine.

Fields and defaults follow vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py``):
``temperature`` defaults to 1.0, ``top_k`` -1 or 0 means off, completions default to 16 tokens
and chat to what is left of the context; vLLM's extensions (``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``, ``priority``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs``) are accepted here
too.

Rule: a field the server does not honour is refused with a 400 that names it (``param``), never
silently dropped. vLLM ignores unknown fields with a warning; here a field no model declares is
refused too (`StrictBody.refuse_unknown`), with the reason for the known ones this server
cannot do (`NOT_SUPPORTED`: beam search, the deprecated ``functions``, tools outside chat, ...).
A field sent as ``null`` and ``tool_choice: "none"`` ask for nothing and pass. Structured
output (``response_format``, ``structured_outputs``, ``guided_*``) and chat's tools are
declared here and read, key by key, by `vconsole.entrypoints.openai.structured` and
`vconsole.entrypoints.openai.tools`. Fields declared but not honoured in every combination (``logit_bias``, ``suffix``,
``best_of`` other than ``n``, ``prompt_logprobs`` with ``stream`` (as vLLM), ``max_tokens: 0``
without ``echo``, ``stream_options`` without ``stream``) are refused by each request's
`unsupported`.

Prompt logprobs, as vLLM: ``prompt_logprobs: k`` (0..20) asks the engine for every prompt
position's logprob, rank and top k (the response's ``prompt_logprobs``); on completions,
``echo`` with ``logprobs: N`` asks for them too (top N) and puts the prompt's tokens first in
the legacy ``logprobs`` block, and ``max_tokens: 0`` with ``echo`` returns the prompt alone.

`BadRequest` is what every handler raises for a request it refuses; the server turns it into the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vconsole.wire.protocol import PRIORITY_MAX, PRIORITY_MIN


class BadRequest(ValueError):
    """A request the server refuses: HTTP ``status`` with the OpenAI error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}


# Fields the server knows it cannot do (here): what each asks for (the 400's message says it).
# Tool calling is chat's (`ChatCompletionRequest` declares those fields): elsewhere it is refused.
_TOOLS = "tool calling outside /v1/chat/completions"
NOT_SUPPORTED: dict[str, str] = {
    "tools": _TOOLS, "tool_choice": _TOOLS, "parallel_tool_calls": _TOOLS,
    "functions": "the deprecated `functions` API (send `tools`)",
    "function_call": "the deprecated `function_call` API (send `tool_choice`)",
    "guided_whitespace_pattern": "a whitespace pattern for guided decoding",
    "use_beam_search": "beam search",
    "length_penalty": "beam search", "logits_processors": "logits processors",
    "allowed_token_ids": "restricting the vocabulary", "bad_words": "banned words",
    "audio": "audio", "modalities": "audio output", "prediction": "predicted outputs",
    "reasoning_effort": "reasoning models", "web_search_options": "web search",
    "lora_request": "LoRA adapters",
}
# Values of those fields that ask for nothing this server lacks (OpenAI's defaults).
ASKS_NOTHING: dict[str, tuple[Any, ...]] = {"tool_choice": ("none",)}


def refusal(name: str) -> str:
    """The 400's message for a field this server does not honour."""
    if name in NOT_SUPPORTED:
        return (f"{name}: {NOT_SUPPORTED[name]} is not supported by this server; it refuses "
                "the request rather than ignore the field")
    return (f"{name}: unknown field; this server refuses a field it does not honour rather "
            "than ignore it (docs/serve.md lists the fields it takes)")


class StrictBody(BaseModel):
    """A request body that keeps the fields no model declares, to refuse them by name."""

    model_config = ConfigDict(extra="allow")

    def refuse_unknown(self, where: str = "") -> None:
        """`BadRequest` naming the first undeclared field that asks for something (``where``:
        the body's path, ``messages.0.`` for a message)."""
        for name, value in (self.model_extra or {}).items():
            if value is None or value in ASKS_NOTHING.get(name, ()):
                continue
            raise BadRequest(refusal(where + name), param=where + name)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StrictBody):
    """What completions and chat share: sampling, stopping, and vLLM's extensions. ``user``
    is OpenAI's end-user tag: accepted, and it changes nothing in the output (as OpenAI)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Structured output (`vconsole.entrypoints.openai.structured` reads them): their values
    # are checked there, so a 400 names the exact key.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_fields(self) -> dict[str, Any]:
        """The structured-output fields as sent (nulls included)."""
        return {name: getattr(self, name) for name in STRUCTURED_FIELDS}

    def unsupported(self) -> None:
        """Refuse what the server cannot do yet, naming the field."""
        self.refuse_unknown()
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true",
                             param="stream_options")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by this server yet",
                             param="logit_bias")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest("prompt_logprobs are not available when stream is true (as in "
                             "vLLM)", param="prompt_logprobs")

    def engine_logprobs(self) -> int | None:
        """How many top logprobs per token the engine computes (None: none)."""
        return None

    def engine_prompt_logprobs(self) -> int | None:
        """How many top logprobs per prompt position the engine computes (None: none)."""
        return self.prompt_logprobs

    def engine_sampling(self, max_tokens: int, index: int = 0) -> dict[str, Any]:
        """The engine's sampling arguments (`vconsole.wire.protocol.SAMPLING_KEYS`) for
        sample ``index`` of ``n``: each sample of a seeded request gets its own seed."""
        out: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "ignore_eos": self.ignore_eos}
        for key, off in (("min_p", 0.0), ("min_tokens", 0), ("presence_penalty", 0.0),
                         ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, key)
            if value is not None and value != off:
                out[key] = value
        if self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({max_tokens})", param="min_tokens")
        if self.seed is not None:
            out["seed"] = (self.seed + index) % 2**63
        if self.engine_logprobs() is not None:
            out["logprobs"] = self.engine_logprobs()
        if self.engine_prompt_logprobs() is not None:
            out["prompt_logprobs"] = self.engine_prompt_logprobs()
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "guided_decoding_backend")
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]                     # type: ignore[arg-type]
        return list(p)                           # type: ignore[arg-type]

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, and with ``echo`` also ``logprobs`` (the echoed prompt's
        tokens carry logprobs in the legacy block): the larger of the two."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                 if k is not None]
        return max(asked) if asked else None

    @property
    def echo_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens 0 generates nothing; it is only allowed with echo: "
                             "true (the prompt and its logprobs)", param="max_tokens")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of is not supported", param="best_of")


class ToolCallFunction(StrictBody):
    name: str
    arguments: str


class ToolCallParam(StrictBody):
    """A call in an assistant message of the history (what the server returned earlier)."""

    id: str
    type: str = "function"
    function: ToolCallFunction

    def template_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class ChatMessage(StrictBody):
    """One message: ``role``, ``content`` and ``name`` (passed to the chat template, as vLLM
    does); an assistant's ``tool_calls`` and a tool message's ``tool_call_id`` (rendered as
    `vconsole.entrypoints.openai.tools.template_messages` says); other fields are refused
    unless null."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees of this message."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def refuse_unknown(self, where: str = "") -> None:
        super().refuse_unknown(where)
        if self.tool_calls:
            if self.role != "assistant":
                raise BadRequest(f"{where}tool_calls: only an assistant message carries tool "
                                 "calls", param=f"{where}tool_calls")
            for i, call in enumerate(self.tool_calls):
                call.refuse_unknown(f"{where}tool_calls.{i}.")
                call.function.refuse_unknown(f"{where}tool_calls.{i}.function.")
                if call.type != "function":
                    raise BadRequest(f"{where}tool_calls.{i}.type: only function calls",
                                     param=f"{where}tool_calls.{i}.type")
        if self.tool_call_id is not None and self.role != "tool":
            raise BadRequest(f"{where}tool_call_id: only a tool message answers a call",
                             param=f"{where}tool_call_id")

    def text(self) -> str:
        """The content as text (a list of parts: its text parts, joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise BadRequest(f"message content of type {part.get('type')!r} is not "
                                 "supported (text only)", param="messages")
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools (`vconsole.entrypoints.openai.tools` checks them, naming the exact key).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        for i, message in enumerate(self.messages):
            message.refuse_unknown(f"messages.{i}.")

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None      # with messages: rendered as chat shows them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]

