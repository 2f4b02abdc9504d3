"""The OpenAI API's request bodies, as vLLM's server accepts them, and their mapping to the engine.

Fields and defaults follow vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py``):
``temperature`` defaults to 1.0, ``top_k`` -1 or 0 means off, completions default to 16 tokens
and chat to what is left of the context; vLLM's extensions (``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``, ``priority``,
``include_stop_str_in_output``, ``skip_special_tokens``) are accepted here too. Unknown fields
are ignored, as vLLM does. A field the engine cannot honour yet (``logit_bias``, ``suffix``,
``best_of``, ``logprobs`` with ``echo``) is refused with a 400 that names it (`unsupported`),
never silently dropped.

`BadRequest` is what every handler raises for a request it refuses; the server turns it into the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vconsole.engine.proc.protocol import PRIORITY_MAX, PRIORITY_MIN


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


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stopping, and vLLM's extensions."""

    model_config = ConfigDict(extra="allow")

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

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> None:
        """Refuse what the engine cannot do yet, naming the field."""
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by this server yet",
                             param="logit_bias")

    def engine_logprobs(self) -> int | None:
        """How many top logprobs per token the engine computes (None: none)."""
        return None

    def engine_sampling(self, max_tokens: int, index: int = 0) -> dict[str, Any]:
        """The engine's sampling arguments (`vconsole.engine.proc.protocol.SAMPLING_KEYS`) for
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
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
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

    def unsupported(self) -> None:
        super().unsupported()
        if self.logprobs is not None and self.echo:
            raise BadRequest("logprobs with echo (the prompt's logprobs) is not supported by "
                             "this server yet", param="echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of is not supported", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

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

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]

