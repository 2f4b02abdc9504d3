"""What a request asks for: its sampling parameters and its structured-output constraint.

Plain data both sides of the request socket use (as vLLM's ``vllm/sampling_params.py``): a
client builds a `SamplingParams`, `vconsole.wire.protocol` carries it as a map, the engine
samples by it. `SamplingParams.validate` is the one set of checks; the engine's input thread
runs it on every ``add`` before a request exists.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by a
# temperature that small overflows float32 and would turn every row into NaN.
SAMPLING_EPS = 1e-5
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20      # top logprobs per token, at most (OpenAI's limit)

# What a structured-output spec may constrain the output to (vLLM's ``structured_outputs``
# fields). Their index + 1 is the ``constraint`` code of the request table (0: none).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A request's structured-output constraint, as plain text (hashable: the engine caches
    compiled grammars by it; `vconsole.engine.structured` compiles it).

    ``value`` per ``kind``: ``json`` the JSON Schema as JSON text; ``json_object`` "" (any JSON
    object); ``regex`` the pattern; ``choice`` a JSON array of strings as text (the output is
    exactly one of them); ``grammar`` a Lark grammar (llguidance's dialect) or GBNF text."""

    kind: str
    value: str

    def validate(self) -> None:
        """Raise ValueError with the reason unless the spec is well formed (whether its
        grammar compiles is `vconsole.engine.structured.grammar.check_spec`'s question)."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output: kind must be one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output: value must be a string, got "
                             f"{type(self.value).__name__}")
        if self.kind == "choice":
            choices = self.choices()
            if not choices:
                raise ValueError("structured output: choice needs at least one string")
        elif self.kind in ("json", "regex", "grammar") and not self.value.strip():
            raise ValueError(f"structured output: {self.kind} needs a non-empty value")

    def choices(self) -> list[str]:
        """A ``choice`` spec's strings; ValueError unless ``value`` is a JSON list of them."""
        try:
            choices = json.loads(self.value)
        except ValueError:
            raise ValueError("structured output: choice must be a JSON array of strings") \
                from None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("structured output: choice must be a JSON array of strings")
        return choices

    @property
    def code(self) -> int:
        """The request table's ``constraint`` code: 1 + the kind's index (0 means none)."""
        return STRUCTURED_KINDS.index(self.kind) + 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or below `SAMPLING_EPS`) = greedy; top_k 0 and
    top_p 1.0 = off.

    Invariant: a `SamplingParams` that passed `validate` samples correctly for every value it
    holds: numbers are finite, in range and of the right type (``bool`` is not an integer)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0               # drop tokens below min_p x the top token's probability
    min_tokens: int = 0              # no EOS / stop token before this many output tokens
    presence_penalty: float = 0.0    # OpenAI's: minus this once per token already output
    frequency_penalty: float = 0.0   # minus this per earlier output of the token
    repetition_penalty: float = 1.0  # HF's: logits of prompt and output tokens / (or x) this
    logprobs: int | None = None      # per output token: its logprob and the top N (0: its own)
    # Per prompt position after the first: its token's logprob and rank and the top N (vLLM's
    # ``prompt_logprobs``), from the forward pass that prefills the prompt. Such a request
    # does not read the prefix cache (every position is computed; it still writes the cache).
    prompt_logprobs: int | None = None
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (see
    # `StructuredSpec`); the engine compiles it before the request is scheduled.
    structured: StructuredSpec | None = None

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got "
                             f"{self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or not math.isfinite(
                self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty!r}")

        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                             f"{self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured must be a StructuredSpec, got "
                                 f"{type(self.structured).__name__}")
            self.structured.validate()
            if self.ignore_eos:
                raise ValueError("structured output and ignore_eos cannot be combined: the "
                                 "grammar decides where the output ends")
            # min_tokens bans EOS and the stop tokens after the grammar's mask: where the
            # grammar allows only those, no token would be left to sample.
            if self.min_tokens:
                raise ValueError("structured output and min_tokens cannot be combined: the "
                                 "grammar decides where the output ends")

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
