"""`vconsole serve --model smollm2`, driven by the real `openai` SDK as a user would: first a
plain chat question (the real model, its chat template and greedy decoding end to end: it
knows the capital of France) and `vconsole load --api-url` through the same server; then
structured outputs and tools: a Pydantic model parsed out of `chat.completions.parse`, `tools`
with `tool_choice` "required" and a named function whose arguments validate against the
function's schema, a streamed `json_schema` answer that parses when joined, a choice and a
regex on completions, and `tool_choice: "auto"` (the server started with
`--enable-auto-tool-choice --tool-call-parser hermes`) answering a well-formed message; Ctrl-C
stops it with exit code 0. One server for the module (a start costs 10-20 s on two cores); the
Hermes reader itself is unit-tested in tests/entrypoints/openai/test_structured_api.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from support.live_engine import ipc_endpoints
from vconsole.cli import build_parser
from vconsole.commands import load as load_cmd
from vconsole.engine.launch.child import ChildProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Capital(BaseModel):
    country: Literal["France", "Italy", "Spain"]
    city: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.HTTPError, OSError):
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
           ) -> Iterator[tuple[int, openai.OpenAI]]:
    tmp = tmp_path_factory.mktemp("serve_smollm2")
    port, log = _free_port(), tmp / "serve.log"
    eps = [f"--{name}={ep}" for name, ep in ipc_endpoints(tmp).items()]
    with open(log, "wb") as out:
        child = ChildProcess([sys.executable, "-m", "vconsole", "serve", "--model", "smollm2",
                              "--port", str(port), "--num-kv-blocks", "128",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              *eps], stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield port, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                  max_retries=0, timeout=120)
        child.send_signal(signal.SIGINT)                     # Ctrl-C: both stop, exit 0
        assert child.wait(60) == 0, log.read_text()[-3000:]
    finally:
        child.kill()          # its group: the engine too


@pytest.fixture(scope="module")
def client(server: tuple[int, openai.OpenAI]) -> openai.OpenAI:
    return server[1]


def test_serve_smollm2_knows_the_capital_of_france(server: tuple[int, openai.OpenAI],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    port, client = server
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    reply = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = reply.choices[0].message.content or ""
    assert "Paris" in text, text
    assert reply.choices[0].finish_reason == "stop"       # it ended its turn by itself
    # the load generator's text prompts, through the same server (its chat template read
    # from the model directory /v1/models names)
    args = build_parser().parse_args(["load", "--api-url", f"http://127.0.0.1:{port}",
                                      "--prompts", "chat", "--num", "3",
                                      "--output-len", "8", "--json"])
    assert load_cmd.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 3 and summary["failed"] == 0


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="smollm2", temperature=0, max_tokens=64, response_format=Capital,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    answer = r.choices[0].message.parsed
    assert isinstance(answer, Capital), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_required_tool_calls_validate_against_their_functions(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=96,
                                       messages=ASK,  # type: ignore[arg-type]
                                       tools=[WEATHER, TIME],  # type: ignore[list-item]
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # streamed: a head per call, then fragments that join into the same arguments
    chunks = list(client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=96, messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice="required", stream=True))  # type: ignore[list-item]
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.id:
                calls[d.index] = {"name": d.function.name or "", "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=64, messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice={"type": "function",  # type: ignore[list-item]
                                            "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result in the history, answered under a schema
    r = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=48, response_format={"type": "json_object"},
        messages=[*ASK, {"role": "assistant", "content": None,  # type: ignore[list-item]
                         "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_a_streamed_json_schema_answer_parses_when_joined(client: openai.OpenAI) -> None:
    schema = Capital.model_json_schema()
    chunks = list(client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=64, stream=True,
        messages=[{"role": "user", "content": "Give the capital of Italy as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "Capital", "schema": schema, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_choices_and_regexes_on_completions_and_a_bad_one_is_a_400(client: openai.OpenAI
                                                                     ) -> None:
    r = client.completions.create(model="smollm2", prompt="Is the sky blue? Answer:",
                                  max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="smollm2", prompt="The year the Eiffel Tower opened:",
                                  max_tokens=8, temperature=0.8, n=2, seed=3,
                                  extra_body={"guided_regex": r"1[0-9]{3}"})
    assert all(re.fullmatch(r"1[0-9]{3}", c.text) for c in r.choices), r.choices
    with pytest.raises(openai.BadRequestError, match="structured output") as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "nonsense"}})
    assert e.value.body["param"] == "guided_json"                      # type: ignore[index]


def test_auto_tool_choice_answers_a_well_formed_message(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kw: dict[str, Any] = dict(model="smollm2", temperature=0, max_tokens=48, messages=ASK,
                                  tools=[WEATHER, TIME])
        if not stream:
            r = client.chat.completions.create(**kw)
            message, finish = r.choices[0].message, r.choices[0].finish_reason
            calls = message.tool_calls or []
            assert (finish == "tool_calls") == bool(calls) or finish == "length"
            assert calls or message.content
            for call in calls:
                assert call.function.name in ("get_weather", "get_time")
                json.loads(call.function.arguments)
        else:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_unknown_tool_call_parser_is_one_line_at_start_up(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vconsole", "serve", "--port", "0",
                           "--tool-call-parser", "mistral"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "vconsole serve: --tool-call-parser 'mistral' is not one this server has: hermes"]
    done = subprocess.run([sys.executable, "-m", "vconsole", "serve", "--port", "0",
                           "--enable-auto-tool-choice"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "needs --tool-call-parser" in done.stderr
