"""A `StructuredSpec` as llguidance grammar text, and whether it compiles.

`check_spec` is what the HTTP server calls to answer a spec that can never compile with a 400
before anything streams; given the model's tokenizer it also checks what only the vocabulary
decides (a token range past its end, a special token it lacks). The engine compiles the same
text against its tokenizer (`vconsole.engine.structured.compiler`).

JSON schemas compile without free whitespace (``whitespace_flexible: false``: ``{"a":1}``, not
``{ "a" : 1 }``), so outputs stay short and a model cannot wander off into blanks; a schema
may say otherwise with llguidance's ``"x-guidance"`` key.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from vconsole.wire.sampling import StructuredSpec

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from llguidance._lib import JsonCompileOptions

PREFIX = "structured output: "
# JSON compile options applied before the schema's own "x-guidance" (llguidance's defaults).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")


def is_gbnf(text: str) -> bool:
    """GBNF (llama.cpp's: ``root ::= ...``) rather than llguidance's Lark (``start: ...``)."""
    return not is_lark_syntax(text) and _GBNF_RULE.search(text) is not None


def to_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar for ``spec``. Raises ValueError (``"structured output: ..."``)
    when the spec is malformed or its text cannot be converted; whether the grammar compiles
    is `check_spec`'s (or the matcher's) question."""
    spec.validate()
    kind, value = spec.kind, spec.value
    if kind == "json" or kind == "json_object":
        schema = value if kind == "json" else ANY_OBJECT_SCHEMA
        try:
            json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{PREFIX}the JSON schema is not valid JSON: {e}") from None
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise ValueError(f"{PREFIX}{e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # Lark string literals take JSON's escapes: each choice is matched exactly.
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                      for c in spec.choices())
        return LLMatcher.grammar_from_lark(lark)
    # grammar: GBNF converted to Lark, or Lark as given
    if is_gbnf(value):
        try:
            value = gbnf_to_lark(value)
        except Exception as e:   # the converter raises its own error types
            raise ValueError(f"{PREFIX}the GBNF grammar does not convert: {e}") from None
    return LLMatcher.grammar_from_lark(value)


def check_spec(spec: StructuredSpec, tokenizer: LLTokenizer | None = None) -> None:
    """Raise ValueError (``"structured output: <reason>"``) unless ``spec`` compiles: the
    grammar alone without ``tokenizer``, against its vocabulary with it (the model's, as
    `compiler.build_tokenizer` makes it); a few ms for a typical schema."""
    grammar = to_grammar(spec)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(PREFIX + first_line(error))


def first_line(error: str) -> str:
    """llguidance's message without the lines after the first (the parser's state, the
    whole grammar: a JSON schema request would get its schema echoed back), except the
    reason a regex parser gives on a later ``error: ...`` line (``regex parse error:
    unclosed character class``)."""
    lines = [line.strip() for line in error.strip().splitlines()]
    head = lines[0] if lines else ""
    reason = next((line[len("error:"):].strip() for line in lines[1:]
                   if line.startswith("error:")), None)
    return f"{head} {reason}" if reason and head.endswith(":") else head
