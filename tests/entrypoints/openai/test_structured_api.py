"""Structured outputs and tools at the HTTP layer, without an engine: the request fields mapped
to the engine's `StructuredSpec`, every refusal a 400 naming its field, the tool schemas and
prompts, the Hermes and JSON tool-call readers (streamed in any pieces), and the chunks a
scripted engine's output becomes, read by the real `openai` SDK over the real app."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from vconsole.engine.structured.grammar import check_spec
from vconsole.engine.worker.tiny_model import build_byte_tokenizer
from vconsole.entrypoints.openai.api_server import build_app
from vconsole.entrypoints.openai.protocol import BadRequest
from vconsole.entrypoints.openai.serving_base import OpenAIServing
from vconsole.entrypoints.openai.structured import spec_of
from vconsole.entrypoints.openai.tool_calls import (
    HermesCalls,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
)
from vconsole.entrypoints.openai.tools import (
    Function,
    plan_tools,
    required_schema,
    takes_tools,
    template_messages,
)
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import StructuredSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
HI = [{"role": "user", "content": "hi"}]


# --- the fields -> the spec ---------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "field", "kind", "value"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "response_format", "json", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object", ""),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", "json", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "structured_outputs.json", "json",
     SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs.regex", "regex",
     "[0-9]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice", "choice",
     ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar",
     "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object",
     "json_object", ""),
    ({"guided_json": SCHEMA}, "guided_json", "json", SCHEMA),
    ({"guided_regex": "a|b"}, "guided_regex", "regex", "a|b"),
    ({"guided_choice": ["x"]}, "guided_choice", "choice", ["x"]),
    ({"guided_grammar": "start: \"a\"", "guided_decoding_backend": "llguidance"},
     "guided_grammar", "grammar", "start: \"a\""),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, "guided_json", "json", SCHEMA),
])
def test_each_field_is_one_spec(fields: dict[str, Any], field: str, kind: str,
                                value: Any) -> None:
    asked = spec_of(fields)
    assert asked is not None
    name, spec = asked
    assert (name, spec.kind) == (field, kind)
    assert (json.loads(spec.value) if kind in ("json", "choice") else spec.value) == value
    spec.validate()


def test_fields_that_ask_for_nothing_are_no_spec() -> None:
    assert spec_of({}) is None
    assert spec_of({"response_format": {"type": "text"}, "guided_json": None,
                    "structured_outputs": None, "guided_decoding_backend": "guidance"}) is None


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "both constrain"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {}}, "structured_outputs", "give one of"),
    ({"structured_outputs": "json"}, "structured_outputs", "an object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "is an object"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needed"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needed"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}},
     "response_format.json_schema.x", "not supported"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema",
     "not supported"),
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend", "llguidance"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_key(fields: dict[str, Any], param: str,
                                                         words: str) -> None:
    with pytest.raises(BadRequest, match=words) as e:
        spec_of(fields)
    assert e.value.param == param


# --- tools --------------------------------------------------------------------------------------

def test_required_is_an_array_of_named_calls_with_each_functions_parameters() -> None:
    plan = plan_tools([WEATHER, TIME], "required", None, auto_enabled=False)
    spec = plan.spec()
    assert spec is not None and spec.kind == "json"
    schema = json.loads(spec.value)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "nope", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(plan_tools([WEATHER, TIME], "required", False,
                                auto_enabled=False).spec().value)   # type: ignore[union-attr]
    assert one["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_a_named_function_is_its_parameters() -> None:
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                      None, auto_enabled=False)
    assert plan.spec() == StructuredSpec("json", json.dumps(
        TIME["function"]["parameters"], separators=(",", ":")))
    assert plan_tools([], None, None, auto_enabled=False).spec() is None
    assert plan_tools([WEATHER], "none", None, auto_enabled=False).shown() == []


RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}, "n": {"type": "integer"}},
             "additionalProperties": False}
WITH_DEFS = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
             "required": ["p"], "$defs": {"P": {"type": "integer"}}}
DRAFT7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
          "properties": {"p": {"$ref": "#/definitions/P"},
                         "default": {"$ref": "#/definitions/Q"}},   # a property so named
          "required": ["p"], "definitions": {"P": {"type": "string", "default": {"$ref": "#"}},
                                             "Q": {"enum": [{"$ref": "#"}]}}}


def test_required_keeps_each_functions_references_its_own() -> None:
    """The required schema takes exactly the calls whose parameters their own function's
    schema takes: a recursive ``#``, ``$defs`` and draft-07 ``definitions``, two functions
    with the same def name, and llguidance compiles it."""
    functions = [Function("tree", parameters=RECURSIVE), Function("defs", parameters=WITH_DEFS),
                 Function("d7.x-1", parameters=DRAFT7),
                 Function("other", parameters={"type": "object", "properties": {
                     "p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "boolean"}}})]
    schema = required_schema(functions)
    jsonschema.Draft202012Validator.check_schema(schema)
    check_spec(StructuredSpec("json", json.dumps(schema)))
    instances = [{}, {"child": {}}, {"child": {"child": {"n": 1}}}, {"child": {"x": 1}},
                 {"child": 3}, {"n": "1"}, {"p": 3}, {"p": "x"}, {"p": True}, {"p": None},
                 {"p": "x", "default": {"$ref": "#"}}, {"p": "x", "default": 1}]
    for fn in functions:
        own = jsonschema.Draft202012Validator(fn.parameters)     # type: ignore[arg-type]
        for args in instances:
            ok = own.is_valid(args)
            assert jsonschema.Draft202012Validator(schema).is_valid(
                [{"name": fn.name, "parameters": args}]) == ok, (fn.name, args, ok)
    assert any(jsonschema.Draft202012Validator(f.parameters).is_valid(a)   # type: ignore
               for f in functions for a in instances)
    assert jsonschema.Draft202012Validator(schema).is_valid(
        [{"name": "tree", "parameters": {"child": {}}}])        # the reviewer's case
    one = required_schema([Function("tree", parameters=RECURSIVE)], parallel=False)
    check_spec(StructuredSpec("json", json.dumps(one)))
    assert one["maxItems"] == 1 and RECURSIVE["properties"]["child"] == {"$ref": "#"}


@pytest.mark.parametrize(("tools", "choice", "param", "words"), [
    ([WEATHER], "auto", "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    ([WEATHER], None, "tool_choice", "--enable-auto-tool-choice"),     # auto is the default
    ([], "required", "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "f"}}, "tool_choice", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice", "not one of"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}},
     "tool_choice.function.name", "not one of the tools"),
    ([WEATHER], {"type": "function"}, "tool_choice", "named function"),
    ([{"type": "code_interpreter"}], "required", "tools.0.type", "only \"function\""),
    ([WEATHER, WEATHER], "required", "tools.1.function.name", "twice"),
    ([{"type": "function", "function": {"name": "a b"}}], "required", "tools.0.function.name",
     "letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required",
     "tools.0.function.parameters", "JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], "required",
     "tools.0.function.returns", "not supported"),
    ([{"type": "function"}], "required", "tools.0.function", "needed"),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}, "bogus": 1},
     "tool_choice.bogus", "not supported"),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time", "strict": True}},
     "tool_choice.function.strict", "not supported"),
    ([WEATHER, {"type": "function", "function": {**TIME["function"], "strict": True}}], "auto",
     "tools.1.function.strict", "need tool_choice \"required\" or a named"),
    ([{"type": "function", "function": {**TIME["function"], "strict": True}}], None,
     "tools.0.function.strict", "\"auto\" does not constrain"),
    ([{"type": "function", "function": {**TIME["function"], "strict": "yes"}}], "required",
     "tools.0.function.strict", "true or false"),
])
def test_tool_requests_the_server_cannot_serve_are_400s(tools: Any, choice: Any, param: str,
                                                        words: str) -> None:
    with pytest.raises(BadRequest, match=words) as e:
        plan_tools(tools, choice, None, auto_enabled="strict" in param)
    assert e.value.param == param


def test_strict_is_taken_where_the_arguments_are_constrained() -> None:
    strict = {"type": "function", "function": {**TIME["function"], "strict": True}}
    assert plan_tools([strict], "required", None, auto_enabled=True).spec() is not None
    named = {"type": "function", "function": {"name": "get_time"}}
    assert plan_tools([strict], named, None, auto_enabled=True).spec() is not None
    assert plan_tools([strict], "none", None, auto_enabled=True).spec() is None
    plain = {"type": "function", "function": {**TIME["function"], "strict": False}}
    assert plan_tools([plain], "auto", None, auto_enabled=True).choice == "auto"


def test_a_template_without_tools_gets_them_in_a_hermes_system_message() -> None:
    smol = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>\\n'}}{% endfor %}")
    assert not takes_tools(smol)
    assert takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
               {"role": "tool", "content": "22C", "tool_call_id": "c2"}]
    convo, tools = template_messages(history, [Function("get_weather", "w", {"type": "object"})],
                                     native=False)
    assert tools is None and [m["role"] for m in convo] == ["system", "user", "assistant",
                                                             "user"]
    assert convo[0]["content"].startswith("be brief\n\n# Tools")
    assert '{"type": "function", "function": {"name": "get_weather"' in convo[0]["content"]
    assert "<tool_call>" in convo[0]["content"]
    assert convo[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris"}}\n</tool_call>')
    assert convo[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                   "<tool_response>\n22C\n</tool_response>")
    native, tools = template_messages(history, [Function("get_weather")], native=True)
    assert tools == [{"type": "function", "function": {"name": "get_weather"}}]
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3] == history[3]
    alone, _ = template_messages(HI, [Function("f")], native=False)
    assert alone[0]["role"] == "system" and alone[1] == HI[0]


# --- reading the calls --------------------------------------------------------------------------

def _pieces(text: str, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        yield text[i:i + n]
        i += n


def _stream(reader: ToolCallStream, text: str, seed: int) -> tuple[str, dict[int, dict[str, Any]]]:
    """The content and calls a client assembles from the reader's events (text in random
    pieces), checking the OpenAI delta shapes as it goes."""
    events = []
    for piece in _pieces(text, seed):
        events += reader.feed(piece)
    events += reader.finish()
    content, calls = "", {}
    for kind, value in events:
        if kind == "content":
            content += value
            continue
        for delta in value:
            if delta["index"] not in calls:               # the head comes first, alone
                assert set(delta) == {"index", "id", "type", "function"}
                assert delta["function"]["arguments"] == "" and delta["type"] == "function"
                assert delta["id"].startswith("call_")
                assert delta["index"] == len(calls)
                calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"],
                                         "arguments": ""}
            else:
                assert set(delta) == {"index", "function"}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"Pa\\"ris </tool", "n": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>\n{"arguments": '
          '{}, "name": "get_time"}\n</tool_call>\n')


@pytest.mark.parametrize("seed", range(12))
def test_hermes_blocks_stream_in_any_pieces_as_the_whole_answer_reads_them(seed: int) -> None:
    content, calls = _stream(HermesCalls(), HERMES, seed)
    whole = HermesCalls()
    whole.feed(HERMES)
    whole.finish()
    text, bodies = whole.result()
    assert content == text == "Let me check."
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [b["function"]["name"] for b in bodies] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls.values()] \
        == [json.loads(b["function"]["arguments"]) for b in bodies] \
        == [{"city": 'Pa"ris </tool', "n": [1, {"x": "}"}]}, {}]


@pytest.mark.parametrize("seed", range(4))
def test_hermes_text_without_calls_is_all_content_even_what_looked_like_a_tag(seed: int) -> None:
    text = "  Hello <tool_ world, a < b and <tool_call too  \n"
    assert _stream(HermesCalls(), text, seed) == (text, {})


def _whole(reader: ToolCallStream, text: str) -> tuple[str, list[tuple[str, str]]]:
    reader.feed(text)
    reader.finish()
    content, bodies = reader.result()
    return content or "", [(b["function"]["name"], b["function"]["arguments"]) for b in bodies]


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
HERMES_TEXTS = {            # text: (content, [(name, arguments)]) as both answers read it
    '<tool_call>[{"name":"get_time","arguments":{}}]</tool_call>':
        ('<tool_call>[{"name":"get_time","arguments":{}}]</tool_call>', []),
    "Let me check. <tool_call>oops not json</tool_call> done":
        ("Let me check. <tool_call>oops not json</tool_call> done", []),
    ' x <tool_call>{"name": 1}</tool_call>\n': (' x <tool_call>{"name": 1}</tool_call>\n', []),
    "<tool_call>not closed, no name <tool_": ("<tool_call>not closed, no name <tool_", []),
    "<tool_call>": ("<tool_call>", []),
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing junk</tool_call> ok':
        ("ok", [("f", '{"a": 1}')]),
    '<tool_call>{"name": "f", "arguments": {"a": 1}}': ("", [("f", '{"a": 1}')]),
    '<tool_call>{"name": "f", "arguments": {"a": [1, 2': ("", [("f", '{"a": [1, 2')]),
    '<tool_call>{"name": "f"}</tool_call>': ("", [("f", "{}")]),
    f"Sure. {CALL}\n\nDone.  ": ("Sure.Done.", [("get_time", '{"zone": "UTC"}')]),
    f"A <tool_call>bad</tool_call> B {CALL} C <tool_call>{{}}</tool_call>":
        ("A <tool_call>bad</tool_call> BC <tool_call>{}</tool_call>",
         [("get_time", '{"zone": "UTC"}')]),
    f"{CALL}{CALL}": ("", [("get_time", '{"zone": "UTC"}')] * 2),
    "no calls < here <tool_call": ("no calls < here <tool_call", []),
}


@pytest.mark.parametrize("text", list(HERMES_TEXTS))
def test_hermes_streams_what_the_whole_answer_reads(text: str) -> None:
    """In any pieces, the stream's content and calls are the non-streamed answer's: a block
    that names no call is content as written, one that names a call is that call whatever
    follows in it (cut or with junk after its object)."""
    expected = HERMES_TEXTS[text]
    assert _whole(HermesCalls(), text) == expected
    for seed in range(12):
        content, calls = _stream(HermesCalls(), text, seed)
        assert (content, [(c["name"], c["arguments"]) for c in calls.values()]) == expected


def test_hermes_odd_outputs() -> None:
    one = HermesCalls(parallel=False)
    one.feed(HERMES)
    one.finish()
    assert [c["function"]["name"] for c in one.result()[1]] == ["get_weather"]
    first_bad = HermesCalls(parallel=False)    # a block that is not a call is no first call
    assert _whole(first_bad, f"<tool_call>x</tool_call>{CALL}{CALL}") == (
        "<tool_call>x</tool_call>", [("get_time", '{"zone": "UTC"}')])
    cut = HermesCalls()          # the output ended inside a block: the call so far
    cut.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    cut.finish()
    assert cut.result()[1][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    after = HermesCalls()        # text after a block is content too
    after.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.')
    after.finish()
    assert after.result()[0] == "Done."


@pytest.mark.parametrize("seed", range(6))
def test_required_arrays_and_named_arguments_stream_in_any_pieces(seed: int) -> None:
    array = ('[{"name":"get_weather","parameters":{"city":"Lyon \\u00e9","tags":["[",'
             '"{"]}}, {"name": "get_time", "parameters": {"zone":"UTC"}}]')
    _, calls = _stream(RequiredCalls(), array, seed)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Lyon é", "tags": ["[", "{"]}), ("get_time", {"zone": "UTC"})]
    content, named = _stream(NamedCall("get_time"), '{"zone": "CET"}', seed)
    assert content == "" and list(named.values())[0]["name"] == "get_time"
    assert json.loads(named[0]["arguments"]) == {"zone": "CET"}
    empty = RequiredCalls()              # cut before the first name: the text stays
    empty.feed('[{"na')
    empty.finish()
    assert empty.result() == ('[{"na', [])
    assert _stream(RequiredCalls(), '[{"na', seed) == ('[{"na', {})      # streamed too


# --- the app, over a scripted engine ------------------------------------------------------------

class ScriptedEngine:
    """An engine link that answers every request with ``script`` (text, one byte token at a
    time, then ``finish_reason``) and records the sampling it was sent."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.info = {"model_path": "scripted", "model": "tiny", "max_model_len": 2048,
                     "vocab_size": len(tokenizer)}
        self.connected = self.healthy = True
        self.in_flight = 0
        self.script, self.finish_reason = "", "stop"
        self.sent: list[dict[str, Any]] = []
        self.prompts: list[str] = []

    async def connect(self) -> None:
        pass

    async def reconnect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def new_id(self, kind: str, given: str | None = None) -> str:
        return given or f"{kind}-1"

    def check_reachable(self) -> None:
        pass

    async def samples(self, request_id: str, prompt_token_ids: Sequence[int],
                      sampling: Sequence[dict[str, Any]], priority: int = 0, *,
                      stopped: set[int] | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        self.sent += sampling
        self.prompts.append(self.tokenizer.decode(prompt_token_ids))
        ids = self.tokenizer(self.script, add_special_tokens=False).input_ids
        for i in range(len(sampling)):
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                yield i, RequestOutput(request_id, [t], finished=last,
                                       finish_reason=self.finish_reason if last else None)


@pytest.fixture(scope="module")
def app_engine() -> Iterator[tuple[openai.OpenAI, ScriptedEngine, TestClient]]:
    tok = build_byte_tokenizer()
    engine = ScriptedEngine(tok)
    serving = OpenAIServing(engine, model_name="tiny", tokenizer=tok,   # type: ignore[arg-type]
                            tool_call_parser="hermes")
    with TestClient(build_app(serving, version="test")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                               http_client=http)
        yield client, engine, http


def test_required_tool_calls_come_back_whole_and_streamed(app_engine: Any) -> None:
    client, engine, _ = app_engine
    engine.script = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER, TIME],
                                       tool_choice="required")
    assert json.loads(engine.sent[-1]["structured"]["value"])["minItems"] == 1
    assert engine.sent[-1]["structured"]["kind"] == "json"
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [("function", "get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, stream=True,
                                                 tools=[WEATHER, TIME], tool_choice="required"))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert chunks[-1].choices[0].delta.tool_calls is None
    assert chunks[0].choices[0].delta.role == "assistant"     # null, as OpenAI sends it
    assert chunks[0].choices[0].delta.content is None


def test_tokenize_renders_tools_as_the_chat_request_does(app_engine: Any) -> None:
    client, engine, http = app_engine
    engine.script = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    client.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER, TIME],
                                   tool_choice="required")
    r = http.post("/tokenize", json={"messages": HI, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    shown = engine.tokenizer.decode(r.json()["tokens"])
    assert shown == engine.prompts[-1] and "get_weather" in shown and "<tools>" in shown
    bare = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    assert len(bare) < r.json()["count"] and "get_weather" not in engine.tokenizer.decode(bare)
    for body, param in (({"prompt": "x", "tools": [WEATHER]}, "tools"),
                        ({"messages": HI, "tools": [{"type": "function", "function": {}}]},
                         "tools.0.function.name")):
        bad = http.post("/tokenize", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_the_first_delta_is_null_content_only_for_answers_that_are_calls(
        app_engine: Any) -> None:
    _, engine, http = app_engine
    named = {"type": "function", "function": {"name": "get_time"}}
    for script, fields, first in (
            ('{"zone": "UTC"}', {"tools": [TIME], "tool_choice": named}, None),
            ('[{"name":"get_time","parameters":{}}]', {"tools": [TIME],
                                                      "tool_choice": "required"}, None),
            ("Hi.", {"tools": [TIME]}, ""),                 # auto: it may be text
            ("Hi.", {"tools": [TIME], "tool_choice": "none"}, ""),
            ("Hi.", {}, "")):
        engine.script = script
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": HI, "stream": True, **fields}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        delta = json.loads(lines[0][6:])["choices"][0]["delta"]
        assert delta == {"role": "assistant", "content": first}, fields
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines)
        assert text == ("Hi." if first == "" else ""), fields


def test_a_named_function_and_auto_over_the_app(app_engine: Any) -> None:
    client, engine, _ = app_engine
    engine.script = '{"zone": "UTC"}'
    r = client.chat.completions.create(
        model="tiny", messages=HI, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert engine.sent[-1]["structured"] == {"kind": "json", "value": json.dumps(
        TIME["function"]["parameters"], separators=(",", ":"))}
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                         {"zone": "UTC"})
    assert r.choices[0].finish_reason == "stop"              # as vLLM and OpenAI: named
    engine.script = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[TIME])
    assert "structured" not in engine.sent[-1]
    assert r.choices[0].message.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"
    assert "<tools>" in engine.prompts[-1] and '"name": "get_time"' in engine.prompts[-1]
    engine.script = "Just text."
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[TIME],
                                       tool_choice="auto", stream=False)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls,
            r.choices[0].finish_reason) == ("Just text.", None, "stop")
    engine.script = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[TIME],
                                       tool_choice="none")
    assert "structured" not in engine.sent[-1] and "<tools>" not in engine.prompts[-1]
    assert r.choices[0].message.content == engine.script    # not read for calls
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_structured_fields_reach_the_engine_and_bad_specs_never_do(app_engine: Any) -> None:
    client, engine, http = app_engine
    engine.script = '{"a":1}'
    before = len(engine.sent)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                  extra_body={"guided_json": SCHEMA})
    assert r.choices[0].text == '{"a":1}'
    assert engine.sent[-1]["structured"]["kind"] == "json"
    for body, param in (
            ({"guided_regex": "("}, "guided_regex"),
            # only the model's vocabulary can refuse these two: the check has it
            ({"guided_grammar": "start: <[99999999]>", "stream": True}, "guided_grammar"),
            ({"structured_outputs": {"grammar": "start: <|no-such-token|>"}},
             "structured_outputs.grammar"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
            ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos"),
            ({"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens"),
            ({"tools": [WEATHER], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
             "tools"),
            ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
            ({"functions": [WEATHER["function"]]}, "functions"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": []}],
              "tool_choice": "none"}, None),
            ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
             "messages.0.tool_call_id"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
                "name": "f", "arguments": "{}", "extra": 1}}]}]},
             "messages.0.tool_calls.0.function.extra")):
        status = http.post("/v1/chat/completions", json={"messages": HI, **body})
        if param is None:
            assert status.status_code == 200, status.text
            continue
        assert status.status_code == 400 and status.json()["error"]["param"] == param, \
            (body, status.text)
    status = http.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert status.status_code == 400 and "outside /v1/chat/completions" in status.text
    assert len(engine.sent) == before + 2     # the completion and the one 200 above


def test_a_streamed_schema_answer_joins_into_the_json(app_engine: Any) -> None:
    client, engine, _ = app_engine
    engine.script = '{"a": 12}'
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HI, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA}}))
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks)) == {"a": 12}
    assert engine.sent[-1]["structured"]["kind"] == "json"
    engine.script = '{"a": 5}'
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history,   # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == '{"a": 5}'
