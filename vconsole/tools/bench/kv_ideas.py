"""`vconsole bench kv-ideas`: the background write-up's memory ideas, answered with data.

Three measurements on the demo's workload (`vconsole.tools.demo`: ``smollm2``, 64 blocks of 16
tokens, 12 seats, 128 tokens a step, the hybrid policy, the chat prompts of
`vconsole.tools.prompts` arriving at the demo's varying rate), all in this process:

1. **Near-duplicate blocks** ("delta-encode similar prefixes"). Every full block of every request
   (prompt and output) is classified by `block_census`: *hash-equal* to an earlier one (the
   prefix cache shares it already), *same tokens under another prefix* (prefix caching cannot
   share it: its hash covers the prefix), *near* (at least ``near_share`` of its positions equal
   to an earlier distinct block's) or *shifted* (its tokens occur elsewhere at another offset).
   For sampled pairs of such blocks, `kv_deltas` recomputes both blocks' K and V with the model
   and measures what a delta against the reference would cost: the bits per value a delta
   needs to keep int8's step of the original (8 + log2(max|delta| / max|x|) per token and
   head), after RoPE as the pool stores K and before it (the best a delta encoder could do).
   Run on the demo's mix and on a serve-like mix (the same prompts through the chat template,
   half of them followed by a second turn that carries the first turn's answer, as a chat
   client sends it to `vconsole serve`).
2. **Block sizes** ("grow block sizes from 64 tokens by 1.5x"). The real run's trace (each
   request's prompt, its output tokens, priority and arrival) is replayed through the real
   `Scheduler` and KV manager at block sizes 8..128 with the same pool memory in tokens; the
   model is replaced by the trace (`replay`: a sampling step returns the token the real model
   produced there), since fragmentation, preemptions and prefix hits depend only on lengths,
   token ids and the order of arrivals, not on numerics. Replayed at the demo's block size it
   reproduces the real run's preemptions (``replay_matches_real``).
3. **KV dtypes at equal memory**: the demo's workload on the real engine with
   ``kv_cache_memory_bytes`` = the demo's float32 pool (64 x 16 tokens) for ``auto``, ``int8``
   and ``int4``: blocks, preemptions, output tokens per second of engine time.

Arrivals are on a virtual clock, so every run sees the same arrival sequence whatever the
machine's load: request i arrives at the demo's Poisson time t_i (`demo_rate`, seeded), and each
engine step advances the clock by `STEP_BASE_S` + `STEP_PER_TOKEN_S` x its tokens (fitted to
``smollm2`` on 2 cores); an idle engine jumps to the next arrival, and the hybrid policy ages
requests on the same clock (their ``arrival_time``). Throughput is measured on the wall clock over
the steps alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.kv.block_pool import hash_block_tokens
from vconsole.engine.request import Request, SamplingParams
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.shared.config import EngineConfig
from vconsole.tools.demo import REAL_ENGINE_DEFAULTS, REAL_RATE
from vconsole.tools.loadgen import Workload, demo_rate, demo_spec

Log = Callable[[str], None] | None

MODEL = "smollm2"
# The demo's engine and rate on the real model (its pool, a byte budget there, as 64 float32
# blocks of 16 tokens), with the block size made explicit.
DEMO_BLOCKS, DEMO_BLOCK_SIZE = 64, 16
DEMO_ENGINE = {k: v for k, v in REAL_ENGINE_DEFAULTS.items() if k != "kv_cache_memory_bytes"}
DEMO_RATE = REAL_RATE
BLOCK_SIZES = (8, 16, 32, 64, 96, 128)
KV_DTYPES = ("auto", "int8", "int4")
NEAR_SHARE = 0.75
# The virtual clock: seconds per step, about smollm2's float32 pace on 2 cores (the 40-request
# run: 506 steps, 51 s virtual against 56 s inside steps at load 3.4-5 with one torch thread).
STEP_BASE_S = 0.08
STEP_PER_TOKEN_S = 0.002
FOLLOW_UPS = ("Can you give one more example?", "Summarize that in one sentence.",
              "Why is that?", "Explain it more simply.")


# --- the workload ------------------------------------------------------------------------------

@dataclass
class Arrival:
    """A request of the workload: its prompt, output limit, priority and virtual arrival time."""

    prompt: list[int]
    max_tokens: int
    priority: int
    at_s: float


@dataclass
class Traced:
    """A finished request as the real engine ran it: what a replay needs."""

    rid: str
    prompt: list[int]
    output: list[int]
    priority: int
    at_s: float
    num_preemptions: int = 0


def demo_arrivals(tokenizer: Any, num: int, seed: int = 0, vocab_size: int = 49152,
                  max_model_len: int = 8192, rate: float = DEMO_RATE) -> list[Arrival]:
    """The demo's requests (`demo_spec` with chat prompts) at the demo's varying Poisson rate,
    on a virtual clock: the same list for the same seed."""
    from vconsole.tools.prompts import ChatRenderer

    workload = Workload(demo_spec(seed, "chat"), vocab_size, max_model_len,
                        chat=ChatRenderer(tokenizer))
    rng, rate_fn, t = random.Random(seed + 1), demo_rate(rate), 0.0
    out = []
    for _ in range(num):
        t += rng.expovariate(rate_fn(t))
        ids, max_tokens, priority = workload.next()
        out.append(Arrival(ids, max_tokens, priority, t))
    return out


# --- driving a scheduler on the virtual clock -------------------------------------------------

@dataclass
class RunStats:
    """One run over a workload: steps, preemptions, the pool's waste averaged over steps."""

    steps: int = 0
    preemptions: int = 0
    output_tokens: int = 0
    engine_s: float = 0.0          # wall time inside steps
    virtual_s: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    wasted_slots_sum: float = 0.0  # per step: used blocks x B - tokens stored
    used_slots_sum: float = 0.0
    pool_slots: int = 0
    rejected: int = 0
    traced: list[Traced] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "steps": self.steps, "preemptions": self.preemptions,
            "output_tokens": self.output_tokens, "rejected": self.rejected,
            "engine_s": round(self.engine_s, 2), "virtual_s": round(self.virtual_s, 1),
            "output_tok_s": round(self.output_tokens / self.engine_s, 1)
            if self.engine_s > 0 else None,
            "prefix_hit_rate": round(self.prefix_hits / self.prefix_queries, 4)
            if self.prefix_queries else 0.0,
            # internal fragmentation: slots allocated but empty (the partial last blocks), as a
            # share of allocated slots and of the pool, averaged over steps
            "fragmentation": round(self.wasted_slots_sum / self.used_slots_sum, 4)
            if self.used_slots_sum else 0.0,
            "wasted_slots_mean": round(self.wasted_slots_sum / n, 1),
            "wasted_share_of_pool": round(self.wasted_slots_sum / n / self.pool_slots, 4)
            if self.pool_slots else 0.0,
        }


def _drive(scheduler: Scheduler, arrivals: Sequence[Arrival],
           make: Callable[[str, Arrival], Request],
           step: Callable[[], tuple[int, list[Request]]], clock: list[float],
           max_steps: int = 1_000_000) -> RunStats:
    """Add arrivals as the virtual clock passes them, step until everything finished."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    stats = RunStats(pool_slots=kv.num_blocks * kv.block_size)
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    i, n = 0, len(arrivals)
    reqs: list[tuple[Request, Arrival]] = []
    while (i < n or scheduler.has_requests()) and stats.steps < max_steps:
        while i < n and arrivals[i].at_s <= clock[0]:
            req = make(f"r{i}", arrivals[i])
            try:
                scheduler.add_request(req)
                reqs.append((req, arrivals[i]))
            except ValueError:
                stats.rejected += 1
            i += 1
        if not scheduler.has_requests():
            clock[0] = arrivals[i].at_s
            continue
        t0 = time.perf_counter()
        tokens, finished = step()
        stats.engine_s += time.perf_counter() - t0
        stats.steps += 1
        clock[0] += STEP_BASE_S + STEP_PER_TOKEN_S * tokens
        used = pool.num_used_blocks
        stats.used_slots_sum += used * kv.block_size
        stats.wasted_slots_sum += used * kv.block_size - pool.tokens_stored
    stats.virtual_s = clock[0]
    stats.preemptions = scheduler.num_preemptions_total
    stats.prefix_queries, stats.prefix_hits = kv.prefix_queries - q0, kv.prefix_hits - h0
    for req, a in reqs:
        stats.output_tokens += len(req.output_token_ids)
        stats.traced.append(Traced(req.request_id, list(req.prompt_token_ids),
                                   list(req.output_token_ids), a.priority, a.at_s,
                                   req.num_preemptions))
    return stats


def run_engine(arrivals: Sequence[Arrival], *, model: str = MODEL, **config: Any) -> tuple[
        RunStats, dict[str, Any], Any]:
    """The arrivals through a real in-process `EngineCore` (greedy, stopping at the model's end
    of turn or ``max_tokens``). Returns the run, the engine's pool figures and the core."""
    from vconsole.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=model, **config))
    clock = [0.0]
    core.scheduler.clock = lambda: clock[0]

    def make(rid: str, a: Arrival) -> Request:
        req = core.make_request(rid, prompt_token_ids=a.prompt, priority=a.priority,
                                sampling=SamplingParams(max_tokens=a.max_tokens))
        req.arrival_time = a.at_s       # the hybrid policy ages requests on this clock
        return req

    def step() -> tuple[int, list[Request]]:
        core.step()
        last = core.last_step
        return (last.num_prefill_tokens + last.num_decode_tokens if last else 0), []

    stats = _drive(core.scheduler, arrivals, make, step, clock)
    info = {"num_blocks": core.num_kv_blocks, "block_size": core.config.block_size,
            "kv_cache_dtype": core.runner.kv_cache_dtype,
            "kv_bytes_per_token": core.runner.kv_bytes_per_token,
            "pool_tokens": core.num_kv_blocks * core.config.block_size,
            "forward": core.runner.forward_path}
    return stats, info, core


def replay(trace: Sequence[Traced], block_size: int, num_blocks: int, *,
           max_model_len: int = 8192, **config: Any) -> RunStats:
    """The trace through the real `Scheduler` and KV manager with the model replaced by the
    trace itself: a request's sampling step returns the token the real model produced at that
    point, and it stops after as many tokens as it produced (deterministic; no torch)."""
    clock = [0.0]
    sched = Scheduler(EngineConfig(**{**DEMO_ENGINE, **config}), num_blocks, block_size,
                      max_model_len, clock=lambda: clock[0])
    outputs = {t.rid: t.output for t in trace}
    arrivals = [Arrival(t.prompt, len(t.output), t.priority, t.at_s) for t in trace]
    rids = [t.rid for t in trace]
    by_rid: dict[str, Request] = {}

    def make(_rid: str, a: Arrival) -> Request:
        rid = rids[len(by_rid)]
        req = Request(rid, list(a.prompt), SamplingParams(max_tokens=a.max_tokens,
                                                          ignore_eos=True),
                      priority=a.priority, arrival_time=a.at_s)
        by_rid[rid] = req
        return req

    def step() -> tuple[int, list[Request]]:
        so = sched.schedule()
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = by_rid[rid]
            if req.num_computed_tokens + n == req.num_tokens:
                sampled[rid] = outputs[rid][len(req.output_token_ids)]
        sched.update_from_output(so, ModelRunnerOutput(sampled=sampled))
        return so.total_num_scheduled_tokens, []

    return _drive(sched, arrivals, make, step, clock)


def internal_fragmentation(lengths: Sequence[int], block_size: int) -> tuple[int, int]:
    """(wasted slots, allocated slots) of sequences of these lengths in blocks of this size:
    each wastes the empty tail of its last block."""
    allocated = sum(-(-n // block_size) * block_size for n in lengths)
    return allocated - sum(lengths), allocated


def geometric_blocks(length: int, first: int = 64, growth: float = 1.5) -> list[int]:
    """The write-up's "grow block sizes from 64 tokens by 1.5x" for one request: its blocks are
    64, 96, 144, 216, ... tokens (each 1.5x the last, rounded), as many as cover ``length``."""
    sizes: list[int] = []
    size = float(first)
    while sum(sizes) < length:
        sizes.append(round(size))
        size *= growth
    return sizes


def geometric_fragmentation(lengths: Sequence[int], first: int = 64,
                            growth: float = 1.5) -> tuple[int, int]:
    """(wasted slots, allocated slots) of `geometric_blocks` for sequences of these lengths."""
    allocated = sum(sum(geometric_blocks(n, first, growth)) for n in lengths)
    return allocated - sum(lengths), allocated


# --- near-duplicate blocks --------------------------------------------------------------------

@dataclass
class BlockRef:
    """A full block: sequence index, block index, and the earlier block it duplicates."""

    seq: int
    index: int
    ref_seq: int = -1
    ref_index: int = -1          # for a shifted copy: the token offset in ref_seq
    share: float = 1.0           # positions equal to the reference's


@dataclass
class Census:
    block_size: int
    total: int = 0                       # full blocks, every occurrence
    distinct: int = 0                    # distinct hashes (what a prefix cache stores)
    hash_equal: list[BlockRef] = field(default_factory=list)
    same_tokens: list[BlockRef] = field(default_factory=list)   # other prefix, equal tokens
    near: list[BlockRef] = field(default_factory=list)          # >= near_share positions
    shifted: list[BlockRef] = field(default_factory=list)       # tokens elsewhere, unaligned

    def summary(self) -> dict[str, Any]:
        d = max(self.distinct, 1)
        return {"block_size": self.block_size, "full_blocks": self.total,
                "distinct_hashes": self.distinct,
                "hash_equal": len(self.hash_equal),
                "hash_equal_share": round(len(self.hash_equal) / max(self.total, 1), 4),
                "same_tokens_other_prefix": len(self.same_tokens),
                "near_duplicates": len(self.near),
                "shifted_copies": len(self.shifted),
                "candidates_share_of_distinct": round(
                    (len(self.same_tokens) + len(self.near) + len(self.shifted)) / d, 4)}


def block_census(seqs: Sequence[Sequence[int]], block_size: int,
                 near_share: float = NEAR_SHARE) -> Census:
    """Classify every full block of ``seqs`` (token id lists, in arrival order).

    A block is *hash-equal* when an earlier block has its chain hash (`hash_block_tokens`:
    same tokens after the same prefix; the prefix cache shares it). Among the first occurrences
    of each hash, a block is *same tokens* when an earlier distinct block holds exactly its
    tokens (another prefix), else *near* when at least ``near_share`` of its positions equal an
    earlier distinct block's, else *shifted* when its tokens occur in some sequence at an offset
    that is not a block boundary. The rest are unique. Each block counts once, in that order.
    """
    import numpy as np

    B = block_size
    census = Census(B)
    seen_hash: dict[int, tuple[int, int]] = {}
    seen_tokens: dict[tuple[int, ...], tuple[int, int]] = {}
    rows: list[tuple[int, ...]] = []
    where: list[tuple[int, int]] = []
    unaligned: dict[tuple[int, ...], tuple[int, int]] = {}
    for s, seq in enumerate(seqs):
        for off in range(1, len(seq) - B + 1):
            if off % B:
                unaligned.setdefault(tuple(seq[off:off + B]), (s, off))
    matrix = np.zeros((0, B), dtype=np.int64)
    for s, seq in enumerate(seqs):
        parent: int | None = None
        for i in range(len(seq) // B):
            tokens = tuple(seq[i * B:(i + 1) * B])
            h = hash_block_tokens(parent, tokens)
            parent = h
            census.total += 1
            if h in seen_hash:
                rs, ri = seen_hash[h]
                census.hash_equal.append(BlockRef(s, i, rs, ri))
                continue
            seen_hash[h] = (s, i)
            census.distinct += 1
            if tokens in seen_tokens:
                rs, ri = seen_tokens[tokens]
                census.same_tokens.append(BlockRef(s, i, rs, ri))
            else:
                best, j = 0.0, -1
                if len(rows):
                    if matrix.shape[0] != len(rows):
                        matrix = np.asarray(rows, dtype=np.int64)
                    match = (matrix == np.asarray(tokens)).mean(axis=1)
                    j = int(match.argmax())
                    best = float(match[j])
                if best >= near_share:
                    census.near.append(BlockRef(s, i, *where[j], share=best))
                elif tokens in unaligned:
                    census.shifted.append(BlockRef(s, i, *unaligned[tokens]))
                seen_tokens[tokens] = (s, i)
                rows.append(tokens)
                where.append((s, i))
    return census


def delta_bits(x: Any, ref: Any) -> float:
    """Mean bits per value a delta ``x - ref`` needs to keep int8's step of ``x`` (per row of
    the last dimension: 8 + log2(max|delta| / max|x|), clamped to 0..8)."""
    import torch

    top = x.abs().amax(-1).clamp_min(1e-12)
    dmax = (x - ref).abs().amax(-1)
    bits = 8 + torch.log2(dmax.clamp_min(1e-30) / top)
    return float(bits.clamp(0, 8).mean())


class KVProbe:
    """K (before and after RoPE) and V of every layer for a token sequence, recomputed with the
    model (`transformers`' own forward, hooks on each layer's k_proj and v_proj)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = model.model.layers
        cfg = model.config
        self.kvh = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._cache: dict[int, tuple[list[Any], list[Any], list[Any]]] = {}

    def kv(self, key: int, ids: Sequence[int]) -> tuple[list[Any], list[Any], list[Any]]:
        """Per layer (T, KVH, D): K before RoPE, K after RoPE, V."""
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if key in self._cache:
            return self._cache[key]
        k_pre: list[Any] = []
        vs: list[Any] = []
        hooks = []
        for layer in self.layers:
            attn = layer.self_attn
            hooks.append(attn.k_proj.register_forward_hook(
                lambda _m, _i, o: k_pre.append(o[0].reshape(o.shape[1], self.kvh, self.hd))))
            hooks.append(attn.v_proj.register_forward_hook(
                lambda _m, _i, o: vs.append(o[0].reshape(o.shape[1], self.kvh, self.hd))))
        try:
            with torch.inference_mode():
                ids_t = torch.tensor([list(ids)], device=self.model.device)
                self.model.model(input_ids=ids_t, use_cache=False)
                pos = torch.arange(len(ids), device=ids_t.device)[None]
                cos, sin = self.model.model.rotary_emb(k_pre[0][None], pos)
                k_post = []
                for k in k_pre:
                    kt = k.transpose(0, 1)[None]          # (1, KVH, T, D)
                    _, kr = apply_rotary_pos_emb(kt, kt, cos, sin)
                    k_post.append(kr[0].transpose(0, 1))
        finally:
            for h in hooks:
                h.remove()
        self._cache = {key: (k_pre, k_post, vs)}      # one sequence at a time: memory
        return self._cache[key]


def kv_deltas(probe: KVProbe, seqs: Sequence[Sequence[int]], refs: Sequence[BlockRef],
              block_size: int, *, shifted: bool = False) -> dict[str, Any]:
    """For each (block, reference) pair: relative L2 difference and delta bits of K after RoPE
    (as stored), K before RoPE and V, averaged over layers and pairs; plus per-layer means of
    the relative difference of K before RoPE (layer 0 of equal tokens is identical)."""
    B = block_size
    keys = ("k_rope", "k_pre", "v")
    rel: dict[str, list[float]] = {k: [] for k in keys}
    bits: dict[str, list[float]] = {k: [] for k in keys}
    per_layer: list[list[float]] = []
    pairs = []
    for r in refs:
        a0 = r.index * B
        b0 = r.ref_index if shifted else r.ref_index * B
        pairs.append((r.seq, a0, r.ref_seq, b0))
    by_seq: dict[int, list[Any]] = {}
    for sa, a0, sb, b0 in pairs:     # slices of one sequence at a time (the probe keeps one)
        for s, p in ((sa, a0), (sb, b0)):
            by_seq.setdefault(s, []).append(p)
    slices: dict[tuple[int, int], tuple[list[Any], list[Any], list[Any]]] = {}
    for s, starts in by_seq.items():
        end = max(starts) + B
        k_pre, k_post, v = probe.kv(s, seqs[s][:end])
        for p in starts:
            slices[(s, p)] = ([t[p:p + B].clone() for t in k_post],
                              [t[p:p + B].clone() for t in k_pre],
                              [t[p:p + B].clone() for t in v])
    for sa, a0, sb, b0 in pairs:
        xa, xb = slices[(sa, a0)], slices[(sb, b0)]
        layer_rel = []
        for name, ta, tb in zip(keys, xa, xb, strict=True):
            for la, lb in zip(ta, tb, strict=True):
                r_ = float((la - lb).norm() / la.norm().clamp_min(1e-12))
                rel[name].append(r_)
                bits[name].append(delta_bits(la, lb))
                if name == "k_pre":
                    layer_rel.append(r_)
        per_layer.append(layer_rel)
    out: dict[str, Any] = {"pairs": len(pairs)}
    if not pairs:
        return out
    for name in keys:
        out[f"{name}_rel_diff"] = round(sum(rel[name]) / len(rel[name]), 4)
        out[f"{name}_delta_bits"] = round(sum(bits[name]) / len(bits[name]), 2)
    n_layers = len(per_layer[0])
    means = [sum(p[i] for p in per_layer) / len(per_layer) for i in range(n_layers)]
    out["k_pre_rel_diff_by_layer"] = {str(i): round(means[i], 3)
                                      for i in sorted({0, 1, 2, n_layers // 2, n_layers - 1})}
    return out


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


# --- the serve-like mix ------------------------------------------------------------------------

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


# --- the benchmark ------------------------------------------------------------------------------

def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def kv_ideas_bench(log: Log = None, *, num_requests: int | None = None, seed: int = 0,
                   model: str = MODEL, block_sizes: Sequence[int] = BLOCK_SIZES,
                   kv_dtypes: Sequence[str] = KV_DTYPES, serve_requests: int | None = None,
                   pairs: int = 16, parts: Sequence[str] = ("dtypes", "blocks", "near")
                   ) -> dict[str, Any]:
    """All three measurements (``parts`` picks), as one JSON-able dict."""
    t_start = time.perf_counter()

    def say(message: str) -> None:
        if log is not None:
            log(f"[{time.perf_counter() - t_start:6.1f} s] {message}")

    num = num_requests or 40
    out: dict[str, Any] = {
        "model": model, "num_requests": num, "seed": seed,
        "workload": f"the demo's: demo_spec(chat prompts), demo_rate({DEMO_RATE}) Poisson "
                    f"arrivals on a virtual clock ({STEP_BASE_S} s + {STEP_PER_TOKEN_S} s "
                    "per token a step), greedy, stop at end of turn",
        "engine": {**DEMO_ENGINE, "num_kv_blocks": DEMO_BLOCKS, "block_size": DEMO_BLOCK_SIZE},
        "load_before": _load()}
    from transformers import AutoTokenizer

    from vconsole.engine.worker.model_loader import resolve_model_path

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), local_files_only=True)
    arrivals = demo_arrivals(tokenizer, num, seed, len(tokenizer))
    say(f"{num} requests, {sum(len(a.prompt) for a in arrivals)} prompt tokens, last arrival "
        f"at {arrivals[-1].at_s:.0f} s (virtual)")

    # 3 first: its auto run is the trace the others replay and census.
    bytes_per_token: dict[str, int] = {}
    trace: list[Traced] = []
    auto_core = None
    if "dtypes" in parts or "blocks" in parts or "near" in parts:
        dtype_rows: dict[str, dict[str, Any]] = {}
        memory = None
        for dtype in (kv_dtypes if "dtypes" in parts else ("auto",)):
            cfg: dict[str, Any] = {**DEMO_ENGINE, "block_size": DEMO_BLOCK_SIZE,
                                   "kv_cache_dtype": dtype}
            if memory is None:
                cfg["num_kv_blocks"] = DEMO_BLOCKS
            else:
                cfg["kv_cache_memory_bytes"] = memory
            say(f"real engine, kv_cache_dtype {dtype} (load {_load()}) ...")
            try:
                stats, pool, core = run_engine(arrivals, model=model, **cfg)
            except Exception as e:          # a dtype the engine cannot run yet: say so
                dtype_rows[dtype] = {"error": f"{type(e).__name__}: {e}"}
                say(f"  {dtype}: {dtype_rows[dtype]['error']}")
                continue
            bytes_per_token[dtype] = pool["kv_bytes_per_token"]
            if memory is None:
                memory = DEMO_BLOCKS * DEMO_BLOCK_SIZE * pool["kv_bytes_per_token"]
                trace = stats.traced
                auto_core = core
            del core
            row = {**pool, **stats.summary(), "load_after": _load()}
            dtype_rows[dtype] = row
            say(f"  {dtype}: {row['num_blocks']} blocks, {row['preemptions']} preemptions, "
                f"{row['output_tok_s']} tok/s, load {row['load_after']}")
        if "dtypes" in parts:
            auto, int8 = dtype_rows.get("auto", {}), dtype_rows.get("int8", {})
            out["dtypes"] = {
                "kv_cache_memory_bytes": memory, "runs": dtype_rows,
                "goal": "int8 at most half the preemptions of auto at equal memory",
                # None when it cannot tell: a run failed, or auto never preempted (too light a
                # workload: raise --num-requests)
                "int8_half_the_preemptions": (int8["preemptions"] <= auto["preemptions"] / 2)
                if int8.get("preemptions") is not None and auto.get("preemptions") else None}

    if "blocks" in parts and trace:
        pool_tokens = DEMO_BLOCKS * DEMO_BLOCK_SIZE
        rows = {}
        for B in block_sizes:
            stats = replay(trace, B, pool_tokens // B)
            rows[str(B)] = {"num_blocks": pool_tokens // B, **stats.summary()}
            for k in ("engine_s", "output_tok_s", "virtual_s"):
                rows[str(B)].pop(k)
            rows[str(B)]["virtual_s"] = round(stats.virtual_s, 1)
            wasted, allocated = internal_fragmentation(
                [len(t.prompt) + len(t.output) - 1 for t in trace], B)
            rows[str(B)]["whole_request_waste"] = round(wasted / allocated, 4)
            say(f"  block size {B}: {rows[str(B)]}")
        lengths = [len(t.prompt) + len(t.output) - 1 for t in trace]
        wasted, allocated = geometric_fragmentation(lengths)
        real = out.get("dtypes", {}).get("runs", {}).get("auto", {})
        out["block_sizes"] = {
            "pool_tokens": pool_tokens,
            "method": "the auto run's trace replayed through the real Scheduler and KV manager "
                      "with the model replaced by the trace (same tokens, same arrivals)",
            "replay_matches_real": rows.get(str(DEMO_BLOCK_SIZE), {}).get("preemptions")
            == real.get("preemptions") if real else None,
            "runs": rows,
            "grow_1_5x_from_64": {
                "meaning": "a request's blocks are 64, 96, 144, 216 ... tokens (or one pool-wide "
                           "size stepped 64 -> 96 -> 144: the runs above)",
                "whole_request_waste": round(wasted / allocated, 4) if allocated else 0.0,
                "whole_request_waste_fixed_16": round(
                    internal_fragmentation(lengths, DEMO_BLOCK_SIZE)[0]
                    / max(internal_fragmentation(lengths, DEMO_BLOCK_SIZE)[1], 1), 4)}}

    if "near" in parts and auto_core is not None:
        from vconsole.engine.worker import kv_quant

        runner = auto_core.runner
        bytes_per_token["int8"] = kv_quant.kv_format("int8").bytes_per_token(
            runner.num_layers, runner.num_kv_heads, runner.head_dim, 4)
        say(f"serve-like mix on the auto engine (load {_load()}) ...")
        seqs = serve_sequences(auto_core, serve_requests or num, seed, say)
        model_obj = runner.model
        model_obj.set_attn_implementation("sdpa")  # the probe runs transformers' own forward
        probe = KVProbe(model_obj)
        demo_seqs = [t.prompt + t.output for t in trace]
        say(f"near-duplicate census, demo mix (load {_load()}) ...")
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
        out["near_duplicates"] = near
    out["load_after"] = _load()
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out["quiet_rerun"] = ("HF_HUB_OFFLINE=1 vconsole bench kv-ideas --num-requests "
                          f"{num} --json  # on an otherwise idle machine")
    return out
