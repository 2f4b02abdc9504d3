"""The OpenAI-compatible server against a real engine process, driven by the real `openai` SDK
(and raw HTTP where the SDK hides what is tested). The server runs under uvicorn in a thread of
this process; the engine is the session's shared one (these tests only submit requests)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.live_engine import reference_outputs
from vconsole.entrypoints.openai.api_server import build_app
from vconsole.entrypoints.openai.engine_link import EngineLink
from vconsole.entrypoints.openai.serving_base import OpenAIServing

pytestmark = pytest.mark.proc
API_KEY = "sk-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine: Any, **kw: Any) -> None:
        self.port = _free_port()
        serving = OpenAIServing(EngineLink(engine.endpoints["input"],
                                           engine.endpoints["output"]), model_name="tiny")
        self.serving = serving
        app = build_app(serving, engine_metrics_url=engine.ready.get("metrics"),
                        version="test", **kw)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server not up"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(shared_engine: Any) -> Iterator[Server]:
    with Server(shared_engine) as s:
        yield s


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def http(server: Server, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_names_the_served_model_and_its_context(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_greedy_completions_on_token_ids_match_an_in_process_engine(
        server: Server, client: openai.OpenAI) -> None:
    prompts = [[5, 9, 14, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 30]]
    expected = reference_outputs([(p, 6) for p in prompts])
    for prompt, want in zip(prompts, expected, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == server.serving.tokenizer.decode(want,
                                                                    skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 6


def test_a_list_of_prompts_with_n_samples_and_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["one", "two three"], max_tokens=3,
                                  n=2, seed=11, temperature=1.0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text[:3] for c in r.choices] == ["one", "one", "two", "two"]
    assert r.usage.prompt_tokens == len("one") + len("two three")   # each prompt once
    assert r.usage.completion_tokens == 4 * 3
    again = client.completions.create(model="tiny", prompt=["one", "two three"], max_tokens=3,
                                      n=2, seed=11, temperature=1.0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]   # seeded


def test_chat_renders_the_template_without_an_added_bos(server: Server,
                                                        client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, body = http(server, "POST", "/tokenize", {"messages": messages})
    tokens = json.loads(body)["tokens"]
    text = server.serving.tokenizer.decode(tokens)
    assert status == 200 and text == "<|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    assert tokens[0] != server.serving.tokenizer.bos_token_id
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokens)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_a_stop_string_ends_the_text_before_it_and_frees_the_engine(
        server: Server, client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[4:6]                      # two characters from the middle of the output
    assert len(stop) == 2 and stop not in text[:4]
    r = client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=12,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] \
        == stop
    streamed = client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=12,
                                         temperature=0, stop=stop, stream=True,
                                         extra_body={"ignore_eos": True})
    parts = [c.choices[0].text for c in streamed]
    assert "".join(parts) == r.choices[0].text
    assert server.serving.engine.in_flight == 0       # aborted in the engine, not left running


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
        client: openai.OpenAI) -> None:
    cases = [({"model": "other"}, openai.NotFoundError, "does not exist"),
             ({"max_tokens": 4000}, openai.BadRequestError, "maximum context length is 2048"),
             ({"temperature": -1}, openai.BadRequestError, "temperature"),
             ({"prompt": [1, 99999]}, openai.BadRequestError, "out of vocabulary"),
             ({"extra_body": {"logit_bias": {"5": 1.0}}}, openai.BadRequestError,
              "logit_bias"),
             ({"extra_body": {"min_tokens": 5}}, openai.BadRequestError, "min_tokens")]
    for change, error, words in cases:
        with pytest.raises(error, match=words):
            client.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2,
                                         **change})
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (field, value) the server cannot honour: each must be a 400 naming the field, never ignored.
# (Structured outputs and tools: tests/entrypoints/openai/test_structured_api.py has each refusal.)
REFUSED_CHAT = [
    ("tool_choice", "required"), ("tool_choice", "auto"),      # no tools to call
    ("functions", [TOOL["function"]]), ("function_call", "auto"),
    ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", " "),
    ("reasoning_effort", "low"), ("no_such_field", 1), ("echo", True),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT)
def test_a_chat_field_the_server_does_not_honour_is_a_400_naming_it(
        client: openai.OpenAI, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError, match=field) as e:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["param"] == field and e.value.body["code"] == 400   # type: ignore


def test_completions_and_tokenize_refuse_what_they_do_not_honour_too(
        server: Server, client: openai.OpenAI) -> None:
    for field, value in (("tools", [TOOL]), ("tool_choice", "required"),
                         ("no_such_field", "x")):
        with pytest.raises(openai.BadRequestError, match=field) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                      extra_body={field: value})
        assert e.value.body["param"] == field                        # type: ignore
    with pytest.raises(openai.BadRequestError, match="stream_options") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  stream_options={"include_usage": True})
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{**HI[0], "tool_call_id": "t1"}]},
             "messages.0.tool_call_id"),
            ("/v1/completions", {"prompt": "x", "stream": True,
                                 "stream_options": {"include_usage": True, "other": 1}},
             "stream_options.other"),
            ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),
            ("/detokenize", {"tokens": [5], "what": 1}, "what")):
        status, raw = http(server, "POST", path, body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_fields_sent_with_values_that_ask_for_nothing_are_served(client: openai.OpenAI
                                                                  ) -> None:
    r = client.chat.completions.create(
        model="tiny", max_tokens=2, response_format={"type": "text"}, tool_choice="none",
        user="someone", messages=[{"role": "user", "content": "hi", "name": "ann"}],
        extra_body={"guided_json": None, "tools": None})
    assert r.choices[0].finish_reason in ("length", "stop")


def _raw(server: Server, method: str, path: str, data: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_route_error_has_openais_shape_and_a_message_the_sdk_shows(
        server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="POST /v1/embeddings: no such route"):
        client.embeddings.create(model="tiny", input="x")
    with pytest.raises(openai.NotFoundError, match="/v1/responses: no such route"):
        client.responses.create(model="tiny", input="x")
    cases = [("GET", "/v1/completions", None, 405, "method not allowed; this route takes POST",
              None),
             ("GET", "/docs", None, 404, "no such route", None),
             ("GET", "/openapi.json", None, 404, "no such route", None),
             ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": }', 400,
              "not valid JSON: Expecting value at character", None),
             ("POST", "/v1/completions", b"", 400, "body is empty", None),
             ("POST", "/v1/completions", b"[1, 2]", 400, "must be a JSON object", None),
             ("POST", "/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400,
              "messages.0.role: Field required", "messages.0.role"),
             ("POST", "/v1/completions", b'{"prompt": 5}', 400, "prompt: ", "prompt")]
    for method, path, data, code, words, param in cases:
        status, body = _raw(server, method, path, data)
        error = body["error"]
        assert status == code and set(error) == {"message", "type", "param", "code"}, body
        assert words in error["message"] and error["param"] == param and error["code"] == code


def test_response_ids_are_random_as_vllms(client: openai.OpenAI) -> None:
    ids = [client.completions.create(model="tiny", prompt="x", max_tokens=1).id
           for _ in range(2)]
    chat = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1).id
    streamed = {c.id for c in client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                                        stream=True)}
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1], ids
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat), chat
    assert len(streamed) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", streamed.pop())


def test_health_version_load_detokenize_and_metrics(server: Server,
                                                    client: openai.OpenAI) -> None:
    assert http(server, "GET", "/health")[0] == 200
    assert json.loads(http(server, "GET", "/version")[1]) == {"version": "test"}
    assert json.loads(http(server, "GET", "/load")[1]) == {"server_load": 0}
    status, body = http(server, "POST", "/detokenize", {"tokens": [3 + ord("h"), 3 + ord("i")]})
    assert status == 200 and json.loads(body) == {"prompt": "hi"}
    client.completions.create(model="tiny", prompt="x", max_tokens=2)
    text = http(server, "GET", "/metrics")[1].decode()
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"}' in text
    assert "vllm:generation_tokens_total" in text       # the engine's own series, relayed


def test_load_counts_a_stream_until_it_ends(server: Server) -> None:
    # 480 tokens (most of the shared engine's 512-token pool): a stream the server cannot have
    # finished by the time a CPU-starved test reads its first chunk (40 could, in CI).
    async def run() -> tuple[int, int]:
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = await async_client.completions.create(
            model="tiny", prompt="count", max_tokens=480, stream=True,
            extra_body={"ignore_eos": True})
        during = None
        async for _ in stream:
            if during is None:
                during = json.loads(await asyncio.to_thread(
                    lambda: http(server, "GET", "/load")[1]))["server_load"]
        after = json.loads(http(server, "GET", "/load")[1])["server_load"]
        await async_client.close()
        return during, after
    assert asyncio.run(run()) == (1, 0)


def test_an_api_key_guards_the_v1_routes_only(shared_engine: Any) -> None:
    with Server(shared_engine, api_key=API_KEY) as s:
        assert http(s, "GET", "/v1/models")[0] == 401
        assert http(s, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert http(s, "GET", "/health")[0] == 200
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        assert c.models.list().data[0].id == "tiny"


def test_min_tokens_and_penalties_reach_the_engines_sampler(client: openai.OpenAI) -> None:
    prompt = [21, 22, 23, 24]
    t0 = reference_outputs([(prompt, 1)])[0][0]              # the greedy first token
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body={"stop_token_ids": [t0]})
    assert stopped.usage.completion_tokens == 1
    assert stopped.choices[0].model_extra["stop_reason"] == t0
    held = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"stop_token_ids": [t0], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3                 # t0 banned until 3 tokens
    plain = client.completions.create(model="tiny", prompt=[5] * 12, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    penalised = client.completions.create(model="tiny", prompt=[5] * 12, max_tokens=12,
                                          temperature=0,
                                          extra_body={"ignore_eos": True,
                                                      "repetition_penalty": 5.0,
                                                      "frequency_penalty": 2.0})
    assert penalised.choices[0].text != plain.choices[0].text


def test_logprobs_in_both_of_openais_shapes(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=[31, 32, 33], max_tokens=5,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # A map by token text: byte tokens that are part of a character all read U+FFFD and
        # share one key (as in vLLM), so the map holds 1 to 4 entries.
        assert value <= 0.0 and token in top and 1 <= len(top) <= 4
        assert value >= max(top.values()) - 1e-4             # greedy: the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    plain = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.fixture(scope="module")
def reference(server: Server) -> Any:
    """transformers' model of the served directory, loaded once for the module."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server.serving.engine.info["model_path"],
                                                local_files_only=True,
                                                dtype=torch.float32).eval()


def _reference_prompt_logprobs(reference: Any, ids: list[int]) -> list[float]:
    """transformers' float32 log-softmax of each prompt token after the first."""
    from vconsole.tools.bench.quality import next_token_logprobs, reference_log_softmax

    return next_token_logprobs(reference_log_softmax(reference, [ids]), [ids])[0].tolist()


def test_prompt_logprobs_as_vllm_returns_them(server: Server, client: openai.OpenAI,
                                              reference: Any) -> None:
    ids = [40, 7, 91, 13, 64, 22, 5, 88, 31]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    want = _reference_prompt_logprobs(reference, ids)
    for pos, (entry, token, value) in enumerate(zip(plp[1:], ids[1:], want, strict=True)):
        mine = entry[str(token)]                 # the prompt's own token, first
        assert list(entry)[0] == str(token) and abs(mine["logprob"] - value) < 1e-4, pos
        assert mine["decoded_token"] == server.serving.tokenizer.decode([token])
        by_rank = {v["rank"]: v for v in entry.values()}
        assert len(entry) in (2, 3) and {1, 2} <= set(by_rank)        # the top 2, and its own
        assert by_rank[1]["logprob"] >= by_rank[2]["logprob"] >= min(
            v["logprob"] for v in entry.values())
        assert mine["rank"] <= 2 or mine["logprob"] < by_rank[2]["logprob"]
    assert r.usage.completion_tokens == 2 and len(r.choices[0].text) > 0
    chat = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"                  # type: ignore


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_alone(
        server: Server, client: openai.OpenAI, reference: Any) -> None:
    prompt = "The cat sat on the mat."
    ids = server.serving.tokenizer(prompt).input_ids
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    want = _reference_prompt_logprobs(reference, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want, strict=True)) < 1e-4
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    more = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    m = more.choices[0]
    assert m.text.startswith(prompt) and len(m.logprobs.tokens) == len(ids) + 3
    assert m.logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                              echo=True, logprobs=1, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(s.choices[0].text for s in streamed) == m.text
    assert [t for s in streamed if s.choices[0].logprobs
            for t in s.choices[0].logprobs.token_logprobs] == m.logprobs.token_logprobs
    # The output tokens' offsets count the echoed prompt, streamed or not.
    assert [o for s in streamed if s.choices[0].logprobs
            for o in s.choices[0].logprobs.text_offset] == m.logprobs.text_offset
    assert m.logprobs.text_offset[len(ids)] == len(prompt)
    with pytest.raises(openai.BadRequestError, match="echo") as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"                       # type: ignore


def test_x_request_id_is_echoed_and_names_the_request(server: Server,
                                                     client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=2, extra_headers={"x-request-id": "app-42"})
    assert raw.headers["x-request-id"] == "app-42"
    assert raw.parse().id == "cmpl-app-42"
    status, body = http(server, "POST", "/v1/completions",
                        {"model": "tiny", "prompt": "x", "max_tokens": 2},
                        headers={"x-request-id": "x" * 300})
    assert status == 400 and "x-request-id" in json.loads(body)["error"]["message"]


def test_continuous_usage_stats_put_usage_in_every_chunk(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None and c.usage.prompt_tokens == 3 for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4


def test_a_client_that_goes_away_mid_stream_frees_its_request_in_the_engine(
        server: Server) -> None:
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": "a long one", "max_tokens": 400, "stream": True,
        "ignore_eos": True}), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read(6) == b"data: "                      # it runs in the engine
    assert server.serving.engine.in_flight == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while server.serving.engine.in_flight:
        assert time.monotonic() < deadline, "the request was left running"
        time.sleep(0.05)
    # The engine's own count follows (its /metrics, relayed by the server).
    while "vllm:num_requests_running" not in (text := http(server, "GET", "/metrics")[1]
                                              .decode()) or \
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' not in text:
        assert time.monotonic() < deadline, "the engine still runs the request"
        time.sleep(0.2)


def test_vllm_bench_shaped_load_at_concurrency_16_has_no_failures(server: Server) -> None:
    """What `vllm bench serve` sends: streaming completions with include_usage and
    ignore_eos, the model from /v1/models; every request finishes with exact token counts."""
    async def run() -> list[tuple[int, int, int]]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = (await c.models.list()).data[0].id
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> tuple[int, int, int]:
            async with gate:
                stream = await c.completions.create(
                    model=model, prompt=[3 + (i * 7 + k) % 250 for k in range(24)],
                    max_tokens=6, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                text_chunks, usage = 0, None
                async for chunk in stream:
                    if chunk.choices:
                        text_chunks += 1
                    usage = chunk.usage or usage
                return text_chunks, usage.prompt_tokens, usage.completion_tokens
        try:
            return await asyncio.gather(*(one(i) for i in range(160)))
        finally:
            await c.close()
    results = asyncio.run(run())
    assert len(results) == 160
    assert all(p == 24 and n == 6 and chunks >= 1 for chunks, p, n in results)


ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 6), st.floats(allow_nan=True),
                st.text(max_size=4), st.lists(st.integers(-2, 300), max_size=3),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "priority",
          "repetition_penalty", "logprobs", "stream", "stream_options", "logit_bias",
          "prompt_logprobs"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from([*COMMON, "prompt", "messages", "echo", "bogus"]),
                            ANY, max_size=6),
       base=st.booleans())
def test_no_generated_body_gets_a_5xx_and_every_refusal_says_why(
        server: Server, route: str, body: dict[str, Any], base: bool) -> None:
    if base:      # often a body that is valid but for the generated fields
        body = {("prompt" if route == "/v1/completions" else "messages"):
                "hi" if route == "/v1/completions" else [{"role": "user", "content": "hi"}],
                "max_tokens": 2, **body}
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2                   # the fuzzer is after validation, not throughput
    status, raw = http(server, "POST", route, body)
    assert status < 500, (body, raw[:300])
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] and error["code"] == status


def test_vconsole_load_over_http_sends_the_same_workload_as_over_the_socket(
        server: Server, shared_engine: Any) -> None:
    common = ["--num", "30", "--concurrency", "6", "--prompt-len", "4:16", "--output-len",
              "2:6", "--priority-mix", "0:1,3:2", "--seed", "5", "--json"]
    runs = {}
    for how, where in (("http", ["--api-url", server.url + "/v1"]),
                       ("socket", ["--input", shared_engine.endpoints["input"],
                                   "--output", shared_engine.endpoints["output"]])):
        r = subprocess.run([sys.executable, "-m", "vconsole", "load", *where, *common],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        runs[how] = json.loads(r.stdout)
    for s in runs.values():
        assert s["requests"] == 30 and s["completed"] == 30 and s["errors"] == {}
        assert s["ttft_s"]["p50"] > 0
        # ITL needs a request whose tokens came in two chunks or more; on a loaded machine the
        # server (and the native client) may merge each short output into one chunk.
        assert s["itl_s"]["p50"] is None or s["itl_s"]["p50"] > 0
    assert runs["http"]["output_tokens"] == runs["socket"]["output_tokens"]   # exact counts


async def _sse_request(port: int, body: dict[str, Any], *, read_after: asyncio.Event | None = None
                       ) -> tuple[int, int]:
    """One streaming POST over a raw connection: (data frames, completion tokens). With
    ``read_after``, the client sends its request and then reads nothing until the event is set
    (a slow reader)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    if read_after is not None:
        await read_after.wait()
    frames = tokens = 0
    try:
        while line := await reader.readline():
            if line.startswith(b"data: "):
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                frames += 1
                usage = json.loads(data).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    finally:
        writer.close()
    return frames, tokens


@pytest.mark.slow
def test_a_thousand_concurrent_streams_all_finish_slow_readers_stall_nobody(server: Server
                                                                            ) -> None:
    """1,000 clients stream at once over loopback while 10 others send their request and read
    nothing: every one of the 1,000 finishes with its exact token count while the slow readers
    still hold their streams, then those finish too; a second wave of 1,000 leaves the
    process's memory where the first left it (nothing kept per request)."""
    import psutil

    proc = psutil.Process()

    async def wave(n: int) -> None:
        release = asyncio.Event()
        slow = [asyncio.create_task(_sse_request(server.port, {
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 64, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}},
            read_after=release)) for _ in range(10)]
        fast = await asyncio.wait_for(asyncio.gather(*(_sse_request(server.port, {
            "model": "tiny", "prompt": [3 + i % 200, 9, 10], "max_tokens": 3, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}})
            for i in range(n))), timeout=600)
        # Every fast stream finished while ten streams had not been read at all.
        assert all(tokens == 3 and frames >= 2 for frames, tokens in fast), fast[:5]
        release.set()
        done = await asyncio.wait_for(asyncio.gather(*slow), timeout=300)
        assert all(tokens == 64 for _, tokens in done)

    asyncio.run(wave(1000))
    baseline = proc.memory_info().rss
    asyncio.run(wave(1000))
    grown = proc.memory_info().rss - baseline
    assert grown < 0.1 * baseline, (grown, baseline)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_token_offsets_equal_each_prefix_decodings_length_in_linear_time(
        model: str, request: pytest.FixtureRequest) -> None:
    """Text offsets (completions' ``text_offset``, where a stop string cuts) are each token's
    decoded prefix length, as decoding every prefix gives them, on multi-byte UTF-8 split
    across byte tokens, special tokens and tokens from any start."""
    from transformers import AutoTokenizer

    from vconsole.engine.worker.tiny_model import build_byte_tokenizer
    from vconsole.entrypoints.openai.logprobs import offsets

    tok = (build_byte_tokenizer() if model == "tiny" else AutoTokenizer.from_pretrained(
        request.getfixturevalue("smollm2_dir"), local_files_only=True))
    ids = tok("Héllo wörld — naïve café, 日本語 🎉🎉 don't stop .\n" * 6).input_ids
    ids = ids[:5] + [tok.eos_token_id] + ids[5:]
    prefixes = [len(tok.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids))]
    if model == "tiny":      # characters split across byte tokens: offsets that repeat
        assert len(set(prefixes)) < len(prefixes) - 6
    for start, end in [(0, len(ids)), (3, len(ids) - 7), (41, 60), (9, 10), (5, 5)]:
        assert offsets(tok, ids, start, end) == prefixes[start:end], (start, end)


def test_logprobs_of_minus_infinity_are_clamped_in_both_shapes() -> None:
    """-inf (a token masked out) is -9999 in chat logprobs too, as in completions': JSON has no
    infinity (the server's encoder refuses it)."""
    from vconsole.engine.worker.tiny_model import build_byte_tokenizer
    from vconsole.entrypoints.openai.logprobs import (
        MIN_LOGPROB,
        chat_logprobs,
        completion_logprobs,
    )

    tok = build_byte_tokenizer()
    inf = float("-inf")
    entries = [(inf, [40, 41], [-0.5, inf])]
    chat = chat_logprobs(tok, [41], entries)["content"][0]
    assert chat["logprob"] == MIN_LOGPROB and chat["top_logprobs"][1]["logprob"] == MIN_LOGPROB
    legacy = completion_logprobs(tok, [41], entries)
    assert legacy["token_logprobs"] == [MIN_LOGPROB]
    json.dumps([chat, legacy], allow_nan=False)
