"""Structured output: the request fields that constrain what the model may write, as one
`StructuredSpec` for the engine.

The fields, as vLLM's server takes them (completions and chat alike):

- ``response_format``: OpenAI's ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (kind ``json``) or ``{"type": "json_object"}`` (kind
  ``json_object``: any JSON object); ``{"type": "text"}`` asks for nothing;
- ``structured_outputs`` (vLLM's): exactly one of ``json`` (a schema, or its JSON text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF as llama.cpp writes
  it) or ``json_object: true``;
- the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, with
  ``guided_decoding_backend`` only when it names the engine's backend (llguidance) or ``auto``.

Chat's ``tools`` with ``tool_choice: "required"`` or a named function constrain the output too
(`vconsole.entrypoints.openai.tools`): any two constraints in one request are a 400, as is
anything here the engine does not do (``structural_tag``, ``whitespace_pattern``, ...), naming
the field. A spec that cannot compile is refused before anything is sent to the engine
(`SpecChecker`: the engine's own check against the model's tokenizer, cached per spec), so a
bad schema, or a grammar naming a token the model lacks, is one 400, never a stream that ends
in an error.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from vconsole.entrypoints.openai.protocol import BadRequest
from vconsole.wire.sampling import StructuredSpec

BACKENDS = ("auto", "guidance", "llguidance")    # what guided_decoding_backend may name
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
CHECK_CACHE = 256   # specs whose compile check is remembered (a client resends its schemas)


def spec_of(fields: dict[str, Any]) -> tuple[str, StructuredSpec] | None:
    """The one constraint the request's structured-output ``fields`` (name -> value, nulls
    included) ask for, with the name of the field that asked; None when they ask for none.
    `BadRequest` naming the field for a value this server cannot honour, or for two."""
    asked: list[tuple[str, StructuredSpec]] = []
    rf = fields.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            asked.append(("response_format", spec))
    so = fields.get("structured_outputs")
    if so is not None:
        asked.append(_structured_outputs(so))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            asked.append((name, _spec(kind, fields[name], name)))
    backend = fields.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str)
                                or backend.lower() not in BACKENDS):
        raise BadRequest(f"guided_decoding_backend: {backend!r} is not this server's backend; "
                         f"it decodes with llguidance (send one of {', '.join(BACKENDS)}, or "
                         "nothing)", param="guided_decoding_backend")
    return only_one(asked)


def only_one(asked: Iterable[tuple[str, StructuredSpec]]) -> tuple[str, StructuredSpec] | None:
    """The one constraint of several fields; two are a 400 naming the second."""
    asked = list(asked)
    if len(asked) > 1:
        (first, _), (second, _) = asked[:2]
        raise BadRequest(f"{first} and {second} both constrain the output: send one of them",
                         param=second)
    return asked[0] if asked else None


class SpecChecker:
    """Whether a spec compiles, as the engine will compile it: llguidance's check against the
    model's tokenizer (``make_tokenizer``, built once, on the first check: token ranges and
    special tokens are checked against the vocabulary too). The last `CHECK_CACHE` specs'
    answers are remembered (a client resends its schemas). Called off the event loop."""

    def __init__(self, make_tokenizer: Callable[[], Any]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._answers: OrderedDict[StructuredSpec, str | None] = OrderedDict()

    def check(self, field: str, spec: StructuredSpec) -> None:
        """`BadRequest` naming ``field`` when ``spec`` cannot compile for this model."""
        error = self._error(spec)
        if error is not None:
            raise BadRequest(error, param=field)

    def _error(self, spec: StructuredSpec) -> str | None:
        from vconsole.engine.structured.grammar import check_spec

        with self._lock:
            if spec in self._answers:
                self._answers.move_to_end(spec)
                return self._answers[spec]
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            tokenizer = self._tokenizer
        try:
            check_spec(spec, tokenizer)
            error = None
        except ValueError as e:
            error = str(e)
        with self._lock:
            self._answers[spec] = error
            while len(self._answers) > CHECK_CACHE:
                self._answers.popitem(last=False)
        return error


def engine_field(spec: StructuredSpec) -> dict[str, str]:
    """The engine's ``sampling["structured"]``."""
    return {"kind": spec.kind, "value": spec.value}


def json_text(schema: Any, param: str) -> str:
    """A JSON Schema given as an object or as its JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadRequest(f"{param}: not valid JSON ({e})", param=param) from None
    if not isinstance(schema, dict | bool):
        raise BadRequest(f"{param}: a JSON Schema is an object, not "
                         f"{type(schema).__name__}", param=param)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec("json", json_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise BadRequest(f"{param}: json_object takes true", param=param)
        return StructuredSpec("json_object", "")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str)
                                                              for x in value):
            raise BadRequest(f"{param}: a choice is a non-empty list of strings", param=param)
        return StructuredSpec("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param}: a {kind} is a non-empty string", param=param)
    return StructuredSpec(kind, value)


def _response_format(rf: Any) -> StructuredSpec | None:
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
        kind = rf.get("type") if isinstance(rf, dict) else rf
        raise BadRequest(f"response_format.type: {kind!r} is not supported (send one of "
                         f"{', '.join(RESPONSE_FORMATS)})", param="response_format.type")
    kind = rf["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _refuse_other_keys(rf, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise BadRequest("response_format.json_schema: an object with the schema is needed "
                         "for type json_schema", param="response_format.json_schema")
    _refuse_other_keys(js, set(JSON_SCHEMA_KEYS), "response_format.json_schema")
    if js.get("schema") is None:
        raise BadRequest("response_format.json_schema.schema: the JSON Schema is needed",
                         param="response_format.json_schema.schema")
    # ``strict`` asks that the output follow the schema: it always does here.
    return StructuredSpec("json", json_text(js["schema"], "response_format.json_schema.schema"))


def _structured_outputs(so: Any) -> tuple[str, StructuredSpec]:
    if not isinstance(so, dict):
        raise BadRequest("structured_outputs: an object with one of "
                         f"{', '.join(STRUCTURED_OUTPUTS)}", param="structured_outputs")
    _refuse_other_keys(so, set(STRUCTURED_OUTPUTS), "structured_outputs")
    asked = [(f"structured_outputs.{k}", _spec(k, so[k], f"structured_outputs.{k}"))
             for k in STRUCTURED_OUTPUTS if so.get(k) not in (None, False)]
    if not asked:
        raise BadRequest("structured_outputs: give one of "
                         f"{', '.join(STRUCTURED_OUTPUTS)}", param="structured_outputs")
    one = only_one(asked)
    assert one is not None
    return one


def _refuse_other_keys(body: dict[str, Any], allowed: set[str], where: str) -> None:
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise BadRequest(f"{where}.{key}: not supported by this server; it refuses the "
                             "request rather than ignore the field", param=f"{where}.{key}")
