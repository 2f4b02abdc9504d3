"""The demo's defaults: its engine settings and request rate per kind of model, and its ports.

Plain data, here rather than in `vconsole.tools.demo` (which loads the engine's launcher and
the load generator, and which the command table may not import) so that ``vconsole demo
--help`` (`vconsole.commands.demo_flags`) names the demo's own defaults from the very values
the demo runs with (`vconsole.tools.demo` imports them from here).
"""

from __future__ import annotations

from vconsole.security.endpoints import DEFAULT_INPUT

# The demo's engine on the random-weight tiny model: small enough that bursts fill the KV pool
# and preempt (80 blocks: with the engine's own forward, 128 drained too fast to ever preempt),
# with priorities to show (`vconsole bench soak` runs the same).
DEMO_ENGINE_DEFAULTS: dict[str, int | str] = {"num_kv_blocks": 80, "max_num_seqs": 16,
                                              "policy": "hybrid"}
DEMO_ENGINE_ARGS = [arg for key, value in DEMO_ENGINE_DEFAULTS.items()
                    for arg in (f"--{key.replace('_', '-')}", str(value))]
DEMO_RATE = 8.0
# On a real model (SmolLM2-135M: ~30x tiny's cost per token, ~120 tokens/s decoding on one
# core): a rate its bursts outrun, a pool that a burst's answers outgrow, and a token budget
# that keeps a step with a prefill chunk near a quarter of a second. The pool is a byte budget,
# 64 float32 blocks of SmolLM2 (64 x 16 tokens x 46,080 bytes), so that `vconsole demo
# --kv-cache-dtype int8` shows what the same memory holds quantized (240 blocks: no
# preemptions where float32 has a dozen a minute, docs/kv-memory.md).
REAL_POOL_BLOCKS = 64
REAL_POOL_BYTES = REAL_POOL_BLOCKS * 16 * 46_080
REAL_ENGINE_DEFAULTS: dict[str, int | str] = {"kv_cache_memory_bytes": REAL_POOL_BYTES,
                                              "max_num_seqs": 12,
                                              "max_num_batched_tokens": 128,
                                              "policy": "hybrid"}
REAL_RATE = 0.8
# The default ports of every command (127.0.0.1:5570-5573): the demo's engine takes them when
# they are free, so `vconsole get`, `set`, `top` and `attach` in another shell find it.
DEFAULT_BASE_PORT = int(DEFAULT_INPUT.rsplit(":", 1)[1])

