"""`bench kv-ideas`'s near-duplicate blocks ("delta-encode similar prefixes"): the census of the
demo's mix and of a serve-like mix (chat turns through the template, half with a second turn
that carries the first's answer), the K/V deltas of sampled pairs per class against an
unrelated control, and what delta-encoding the candidates would save."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from vconsole.tools.bench.kv_ideas_census import NEAR_SHARE, BlockRef, block_census
from vconsole.tools.bench.kv_ideas_deltas import KVProbe, kv_deltas
from vconsole.tools.bench.kv_ideas_runs import load_text
from vconsole.tools.bench.kv_ideas_workload import DEMO_BLOCK_SIZE, Traced
from vconsole.wire.sampling import SamplingParams

Log = Callable[[str], None] | None
FOLLOW_UPS = ("Can you give one more example?", "Summarize that in one sentence.",
              "Why is that?", "Explain it more simply.")


def _sample(items: Sequence[BlockRef], n: int, seed: int) -> list[BlockRef]:
    if len(items) <= n:
        return list(items)
    return random.Random(seed).sample(list(items), n)


def _random_pairs(seqs: Sequence[Sequence[int]], B: int, n: int, seed: int) -> list[BlockRef]:
    """Unrelated blocks (different sequences, different tokens): the control."""
    rng = random.Random(seed)
    full = [(s, i) for s, q in enumerate(seqs) for i in range(len(q) // B)]
    out: list[BlockRef] = []
    for _ in range(50 * n):
        if len(out) >= n or len(full) < 2:
            break
        (sa, ia), (sb, ib) = rng.sample(full, 2)
        if sa != sb and seqs[sa][ia * B:(ia + 1) * B] != seqs[sb][ib * B:(ib + 1) * B]:
            out.append(BlockRef(sa, ia, sb, ib, 0.0))
    return out


def near_duplicates(seqs: Sequence[Sequence[int]], probe: KVProbe | None, block_size: int,
                    bytes_per_token: dict[str, int], *, pairs: int = 16,
                    seed: int = 0) -> dict[str, Any]:
    """The census of ``seqs`` and, with a probe, the K/V deltas of sampled pairs per class and
    what delta-encoding them would save."""
    census = block_census(seqs, block_size)
    out: dict[str, Any] = census.summary()
    if probe is None:
        return out
    deltas = {}
    for name, refs, shifted in (("same_tokens_other_prefix", census.same_tokens, False),
                                ("near_duplicates", census.near, False),
                                ("shifted_copies", census.shifted, True),
                                ("unrelated_control", _random_pairs(seqs, block_size, pairs,
                                                                    seed), False)):
        deltas[name] = kv_deltas(probe, seqs, _sample(refs, pairs, seed), block_size,
                                 shifted=shifted)
    out["kv_deltas"] = deltas
    # What delta-encoding the candidates would save: each candidate stored as a delta of
    # `k_rope_delta_bits` / `v_delta_bits` per value instead of 8 (an int8 pool), against the
    # distinct blocks' bytes (the reference blocks must stay resident; scales are ignored).
    saved_int8 = 0.0
    for name, n in (("same_tokens_other_prefix", len(census.same_tokens)),
                    ("near_duplicates", len(census.near)), ("shifted_copies", len(census.shifted))):
        d = deltas[name]
        if not d.get("pairs"):
            continue
        frac = 1 - (d["k_rope_delta_bits"] + d["v_delta_bits"]) / 16
        saved_int8 += n * frac
    distinct = max(census.distinct, 1)
    out["delta_saving"] = {
        "blocks_equivalent": round(saved_int8, 1),
        "share_of_distinct_block_bytes": round(saved_int8 / distinct, 4),
        "bytes_saved_int8_pool": int(saved_int8 * block_size * bytes_per_token["int8"]),
        "bytes_saved_float32_pool": int(saved_int8 * block_size * bytes_per_token["auto"]),
    }
    return out


def serve_sequences(core: Any, num: int, seed: int, log: Log = None) -> list[list[int]]:
    """Chat prompts through the chat template (as `vconsole serve`'s chat route renders them),
    run to their end of turn on ``core`` (an idle `EngineCore`, six at a time); every other
    conversation then sends a second turn carrying the first turn's answer as text. Returns
    each request's prompt + output."""
    from vconsole.engine.offline import run_batch
    from vconsole.tools.loadgen import LoadSpec
    from vconsole.tools.prompts import ChatRenderer, draw_prompt

    rng = random.Random(seed)
    spec = LoadSpec(prompts="chat", output_len=(16, 128))
    tokenizer = core.tokenizer
    renderer = ChatRenderer(tokenizer)
    core.apply_config({"max_num_seqs": 6})
    first = []
    for _ in range(num):
        p = draw_prompt(rng, long=False, shared_system=rng.random() < spec.system_prompt_share)
        first.append((p, renderer.ids(p), rng.randint(*spec.output_len)))
    reqs = [core.make_request(f"t1-{i}", prompt_token_ids=ids,
                              sampling=SamplingParams(max_tokens=n))
            for i, (_, ids, n) in enumerate(first)]
    res = run_batch(core, reqs)
    seqs = [ids + out for (_, ids, _), out in zip(first, res.output_token_ids, strict=True)]
    second = []
    for i, ((p, _, _), out) in enumerate(zip(first, res.outputs, strict=True)):
        if i % 2:
            continue
        msgs = [*p.messages(), {"role": "assistant", "content": out.text},
                {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
        ids = list(tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False,
                                                           add_generation_prompt=True),
                             add_special_tokens=False).input_ids)
        second.append(ids)
    reqs = [core.make_request(f"t2-{i}", prompt_token_ids=ids,
                              sampling=SamplingParams(max_tokens=rng.randint(*spec.output_len)))
            for i, ids in enumerate(second)]
    res2 = run_batch(core, reqs)
    seqs += [ids + out for ids, out in zip(second, res2.output_token_ids, strict=True)]
    if log:
        log(f"serve mix: {len(first)} first turns, {len(second)} second turns, "
            f"{sum(map(len, seqs))} tokens")
    return seqs


def near_section(core: Any, trace: Sequence[Traced], bytes_per_token: dict[str, int], *,
                 serve_requests: int, pairs: int, seed: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Experiment 1 on the auto run's engine ``core``: the demo mix (the ``trace``'s prompts
    and outputs) and a serve-like mix of ``serve_requests`` conversations, each through
    `near_duplicates` with the model's K/V probe; ``bytes_per_token`` by KV dtype (int8's is
    computed here when that run failed)."""
    from vconsole.engine.worker import kv_quant

    runner = core.runner
    bytes_per_token["int8"] = kv_quant.kv_format("int8").bytes_per_token(
        runner.num_layers, runner.num_kv_heads, runner.head_dim, 4)
    say(f"serve-like mix on the auto engine (load {load_text()}) ...")
    seqs = serve_sequences(core, serve_requests, seed, say)
    model_obj = runner.model
    model_obj.set_attn_implementation("sdpa")  # the probe runs transformers' own forward
    probe = KVProbe(model_obj)
    demo_seqs = [t.prompt + t.output for t in trace]
    say(f"near-duplicate census, demo mix (load {load_text()}) ...")
    near = {"demo": near_duplicates(demo_seqs, probe, DEMO_BLOCK_SIZE, bytes_per_token,
                                    pairs=pairs, seed=seed)}
    say(f"  demo: {near['demo']}")
    near["serve"] = near_duplicates(seqs, probe, DEMO_BLOCK_SIZE, bytes_per_token,
                                    pairs=pairs, seed=seed)
    say(f"  serve: {near['serve']}")
    near["definitions"] = {
        "hash_equal": "same chain hash as an earlier block: shared by the prefix cache",
        "same_tokens_other_prefix": "equal tokens, other prefix: not shareable by hash",
        "near_duplicates": f">= {NEAR_SHARE:.0%} of positions equal to an earlier block's",
        "shifted_copies": "its tokens occur elsewhere at an offset off the block grid",
        "delta_bits": "8 + log2(max|x - ref| / max|x|) per token and head, clamped 0..8: "
                      "bits a delta needs to keep int8's step of x",
        "k_rope": "K as the pool stores it (after RoPE); k_pre: before RoPE, the best case "
                  "for a delta encoder that rotates on read"}
    return near
