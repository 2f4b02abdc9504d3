"""The structured-output spec: its checks, its wire form, and `check_spec` (no tokenizer)."""

from __future__ import annotations

import pytest

from vconsole.engine.structured.grammar import check_spec, is_gbnf, to_grammar
from vconsole.shared.stats import CONSTRAINT_KINDS
from vconsole.wire import protocol
from vconsole.wire.sampling import STRUCTURED_KINDS, SamplingParams, StructuredSpec

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
GOOD = [StructuredSpec("json", SCHEMA), StructuredSpec("json_object", ""),
        StructuredSpec("regex", r"\d{3}-\d{4}"), StructuredSpec("choice", '["yes", "n\\"o", "é"]'),
        StructuredSpec("grammar", 'root ::= "(" [0-9]+ ")"'),
        StructuredSpec("grammar", 'start: "a" b\nb: "b"+')]


def test_kinds_and_codes() -> None:
    assert STRUCTURED_KINDS == ("json", "json_object", "regex", "choice", "grammar")
    assert CONSTRAINT_KINDS == STRUCTURED_KINDS     # the request table's names, by code - 1
    assert [StructuredSpec(k, "").code for k in STRUCTURED_KINDS] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("spec, reason", [
    (StructuredSpec("xml", "<a/>"), "kind must be one of"),
    (StructuredSpec("regex", 5), "value must be a string"),  # type: ignore[arg-type]
    (StructuredSpec("choice", "[]"), "at least one string"),
    (StructuredSpec("choice", '["a", 1]'), "JSON array of strings"),
    (StructuredSpec("choice", "yes"), "JSON array of strings"),
    (StructuredSpec("json", " "), "non-empty"),
])
def test_malformed_specs(spec: StructuredSpec, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        SamplingParams(structured=spec).validate()


def test_structured_with_ignore_eos_is_refused() -> None:
    with pytest.raises(ValueError, match="structured output and ignore_eos"):
        SamplingParams(structured=GOOD[0], ignore_eos=True).validate()


def test_structured_with_min_tokens_is_refused() -> None:
    """min_tokens bans EOS after the grammar's mask: where the grammar allows only EOS, no
    token would be left (a refused token was sampled before this was refused)."""
    with pytest.raises(ValueError, match="structured output and min_tokens"):
        SamplingParams(structured=GOOD[0], min_tokens=1, max_tokens=4).validate()
    SamplingParams(structured=GOOD[0], min_tokens=0).validate()


@pytest.mark.parametrize("spec", GOOD, ids=lambda s: s.kind)
def test_good_specs_check(spec: StructuredSpec) -> None:
    check_spec(spec)
    assert to_grammar(spec)


@pytest.mark.parametrize("spec, reason", [
    (StructuredSpec("json", "{bad"), "not valid JSON"),
    (StructuredSpec("json", '{"type": "strin"}'), "strin"),
    (StructuredSpec("json", '{"type": "string", "pattern": "[a-"}'), "unclosed character class"),
    (StructuredSpec("regex", "[a-"), "unclosed character class"),
    (StructuredSpec("grammar", 'start: "x" | foo'), "unknown name"),
    (StructuredSpec("grammar", 'root ::= "(" foo'), "GBNF"),
])
def test_bad_specs_say_why(spec: StructuredSpec, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        check_spec(spec)
    assert str(info.value).startswith("structured output: ")


def test_gbnf_detection() -> None:
    assert is_gbnf('root ::= "a"')
    assert not is_gbnf('start: "a"')
    assert not is_gbnf('%llguidance {}\nstart: "a"')


@pytest.mark.parametrize("spec", GOOD, ids=lambda s: s.kind)
def test_wire_round_trip(spec: StructuredSpec) -> None:
    params = SamplingParams(max_tokens=5, structured=spec)
    wire = protocol.sampling_to_wire(params)
    assert wire["structured"] == {"kind": spec.kind, "value": spec.value}
    assert protocol.parse_sampling(wire, "r") == params
    # a dict of sampling arguments (EngineClient's) may carry the spec itself
    assert protocol.sampling_to_wire({"structured": spec})["structured"] == wire["structured"]
    frames = protocol.encode_add("r", prompt_token_ids=[1, 2], sampling=params)
    header = protocol.decode(frames)
    assert protocol.parse_add(header).sampling == params


@pytest.mark.parametrize("raw, reason", [
    ("json", "exactly 'kind' and 'value'"),
    ({"kind": "json"}, "exactly 'kind' and 'value'"),
    ({"kind": "json", "value": "{}", "x": 1}, "exactly 'kind' and 'value'"),
    ({"kind": 1, "value": "{}"}, "must be strings"),
    ({"kind": "xml", "value": ""}, "kind must be one of"),
    ({"kind": "choice", "value": "[]"}, "at least one"),
])
def test_wire_rejects_malformed(raw: object, reason: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.parse_sampling({"structured": raw}, "r")


def test_wire_rejects_ignore_eos_with_structured() -> None:
    with pytest.raises(protocol.ProtocolError, match="ignore_eos"):
        protocol.parse_sampling({"structured": {"kind": "regex", "value": "a"},
                                 "ignore_eos": True}, "r")
