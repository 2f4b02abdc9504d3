"""The speculative-decoding config (vLLM's ``--speculative-config`` JSON), parsed and checked.

Only vLLM's ``ngram`` method (prompt lookup) exists here: drafts are copied from the request's
own tokens, so no draft model is loaded. The JSON names vLLM's fields::

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2}

``num_speculative_tokens`` is required; ``prompt_lookup_max`` / ``prompt_lookup_min`` default to
each other, and to 5 when neither is given (vLLM's defaults). One field of ours:
``"draft_length"``, ``"adaptive"`` (the default: each request drafts the length of its match
that is expected to pay for its rows, at most ``num_speculative_tokens``,
`vconsole.engine.spec.draft_length`) or ``"fixed"`` (the whole match up to
``num_speculative_tokens``, as vLLM drafts). Any other field, another method, a
value of the wrong type or range is refused with the reason: a field we do not honour is never
silently ignored. Plain data; the engine's `vconsole.engine.spec` does the work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram",)
SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
               "draft_length")
DRAFT_LENGTHS = ("adaptive", "fixed")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    draft_length: str = "adaptive"

    def to_json(self) -> str:
        values: dict[str, Any] = {"method": self.method,
                                  "num_speculative_tokens": self.num_speculative_tokens,
                                  "prompt_lookup_max": self.prompt_lookup_max,
                                  "prompt_lookup_min": self.prompt_lookup_min}
        if self.draft_length != "adaptive":     # vLLM's four fields unless ours was set
            values["draft_length"] = self.draft_length
        return json.dumps(values)


def _int_field(values: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{key} must be in {lo}..{hi}, got {value}")
    return value


def parse_speculative_config(raw: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """``raw``: the JSON text (or its object); None or an empty string: no speculation.
    Raises ValueError with a reason a person can act on."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, str):
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at character {e.pos}): {raw!r}") from None
    else:
        values = raw
    if not isinstance(values, dict):
        raise ValueError(f"expected a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"unsupported field(s) {', '.join(unknown)}; this engine takes "
                         f"{', '.join(SPEC_FIELDS)}")
    method = values.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"method must be one of {', '.join(SPEC_METHODS)} (drafts looked up "
                         f"in the request's own tokens; no draft model), got {method!r}")
    k = _int_field(values, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("num_speculative_tokens is required (drafted tokens per step, "
                         f"1..{MAX_SPECULATIVE_TOKENS})")
    hi = _int_field(values, "prompt_lookup_max", 1, MAX_LOOKUP)
    lo = _int_field(values, "prompt_lookup_min", 1, MAX_LOOKUP)
    if hi is None and lo is None:
        hi = lo = DEFAULT_LOOKUP
    elif hi is None:
        hi = lo
    elif lo is None:
        lo = hi
    assert hi is not None and lo is not None
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
    length = values.get("draft_length", "adaptive")
    if length not in DRAFT_LENGTHS:
        raise ValueError(f"draft_length must be one of {', '.join(DRAFT_LENGTHS)}, got "
                         f"{length!r}")
    return SpeculativeConfig(method, k, hi, lo, length)
