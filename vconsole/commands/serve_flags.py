"""`vconsole serve`'s parser (its handler: `vconsole.commands.serve`): the HTTP server's flags,
then every flag of `vconsole engine` for the engine it starts. Light imports only: `vconsole
--help` loads it."""

from __future__ import annotations

from vconsole.commands.flags import add_engine_command_args, port
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "serve", "vconsole.commands.serve:main",
        "an OpenAI-compatible HTTP server in front of the engine",
        "Start the engine (supervised, every `vconsole engine` flag applies) and an HTTP "
        "server in front of it that speaks OpenAI's API as vLLM's server does: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
        "/detokenize, /load, /version. With --engine-ready-file it fronts an engine that "
        "is already running instead. Use it with the openai SDK, curl or `vllm bench serve`.")
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; beyond loopback, set "
                        "--api-key)")
    g.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` on /v1/ routes "
                        "(default: $VCONSOLE_API_KEY; unset: no key)")
    g.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without --api-key (open to anyone who "
                        "reaches the port)")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients use (default: --model's value)")
    g.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template, instead of the tokenizer's own")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": the model calls tools when it wants, "
                        "read from its text by --tool-call-parser (as vLLM's flag)")
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="how tool calls are read from the text: hermes (<tool_call> blocks, "
                        "the format of Qwen2, Hermes and SmolLM-family templates)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="send a span per request to this OpenTelemetry collector, OTLP over "
                        "HTTP/protobuf (e.g. http://127.0.0.1:4318/v1/traces), with vLLM's "
                        "attribute names; a caller's traceparent header is honoured (as "
                        "vLLM's flag; needs opentelemetry-sdk and "
                        "opentelemetry-exporter-otlp-proto-http)")
    g.add_argument("--enable-per-request-metrics", action="store_true",
                   help="add vLLM's per-request timings (time to first token, queue time, "
                        "generation time, mean ITL, tokens/s) as `metrics` to the response of "
                        "a one-prompt, one-sample request (a stream: to its final usage "
                        "chunk), as vLLM's flag")
    g.add_argument("--engine-ready-file", metavar="PATH",
                   help="front the engine that wrote this ready file (`vconsole engine "
                        "--ready-file PATH`) instead of starting one")
    add_engine_command_args(p)
