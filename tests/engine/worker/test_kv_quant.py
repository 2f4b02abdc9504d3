"""Quantized KV blocks (issue #30): the codes' round trips, the CPU kernel reading int8 / int4
blocks in place, the pool's capacity in bytes, and a real engine on them (greedy output against
``auto``, the kernel against the torch path, prefix-cache hits, preemption, a bad value)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.cxx import HAVE_CXX
from vconsole.cli import build_parser
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import attention_kernel, kv_quant, paged_attention
from vconsole.engine.worker.kv_open_blocks import OpenBlocks
from vconsole.shared.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, validate_config
from vconsole.wire.sampling import SamplingParams

QUANTIZED = ("int8_per_token_head", "int4_per_token_head")
ENGINE_FORMATS = (*QUANTIZED, "int4_kivi", "int8_kivi")
PER_CHANNEL = ("int4_kivi", "int8_kivi")


def _rows(seed: int, n: int = 300, d: int = 64) -> torch.Tensor:
    """K-like rows: normal values, a few outlier channels, some all-zero rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, d, generator=gen)
    x[:, :, 5] *= 20.0
    x[:, :, d - 7] += 9.0
    x[::50] = 0.0
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_is_within_half_a_step(name):
    fmt = kv_quant.kv_format(name)
    x = _rows(1)
    data, params = kv_quant.quantize(fmt, x)
    assert data.dtype == fmt.data_dtype and data.shape[-1] == fmt.data_dim(64)
    assert params.shape == (*x.shape[:-1], fmt.params) and params.dtype == torch.float32
    back = kv_quant.dequantize(fmt, data, params)
    err = (back - x).abs()
    assert (err <= kv_quant.bound(fmt, x) * (1 + 1e-5) + 1e-7).all()
    assert (back[::50] == 0).all()  # zero rows stay zero (padding reads stay finite)
    # The bound is tight enough to mean something: int8 within 0.4% of a row's largest value.
    if fmt.bits == 8:
        assert (err.amax(-1) <= x.abs().amax(-1) / 254 * 1.0001 + 1e-7).all()


def test_aliases_and_bytes_per_token():
    assert kv_quant.kv_format("int8") is kv_quant.kv_format("int8_per_token_head")
    assert kv_quant.kv_format("int4").name == "int4_kivi"
    auto, i8, i4 = (kv_quant.kv_format(n) for n in ("auto", "int8", "int4_per_token_head"))
    # SmolLM2's shape: 30 layers, 3 KV heads, head_dim 64, float32.
    f32 = auto.bytes_per_token(30, 3, 64, 4)
    assert f32 == 2 * 30 * 3 * 64 * 4
    assert i8.bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * (64 + 4)
    assert i4.bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * (32 + 8)
    assert 3.7 < f32 / i8.bytes_per_token(30, 3, 64, 4) < 3.8
    assert 6.3 < f32 / i4.bytes_per_token(30, 3, 64, 4) < 6.5
    # int4_kivi per head and block of 16: K and V data, V's per-token scale and minimum
    # (float16), K's per-channel scale and minimum (float16) shared by the block's 16 tokens.
    kivi = kv_quant.kv_format("int4")
    assert kivi.bytes_per_block(16, 30, 3, 64, 4) == 90 * (2 * 16 * 32 + 16 * 4 + 2 * 2 * 64)
    assert kivi.bytes_per_token(30, 3, 64, 4, 16) == 90 * 84
    # int8_kivi: int8 K and V, V's float16 scale per token, K's float16 scale per channel.
    kivi8 = kv_quant.kv_format("int8_kivi")
    assert kivi8.bytes_per_block(16, 30, 3, 64, 4) == 90 * (2 * 16 * 64 + 16 * 2 + 2 * 64)
    assert 3.7 < f32 / kivi8.bytes_per_token(30, 3, 64, 4, 16) < 3.72
    # Their staging per open block, one block of the pool: it fits int4_kivi's int8 rows with
    # a float32 scale each (K and V data, V's parameters) and int8_kivi's float16 rows (K and V
    # data), exactly.
    assert kv_quant.staging_bytes(kivi, 1, 16, 30, 3, 64) == kivi.bytes_per_block(16, 30, 3, 64, 4)
    assert 90 * 16 * (64 + 4) == 90 * (2 * 16 * 32 + 16 * 4)
    assert kv_quant.staging_bytes(kivi8, 2, 16, 30, 3, 64) == 2 * 90 * (2 * 16 * 64 + 16 * 2
                                                                        + 2 * 64)
    assert 90 * 16 * 64 * 2 == 90 * 2 * 16 * 64


def test_a_bad_kv_cache_dtype_is_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--kv-cache-dtype", "int3"])
    err = capsys.readouterr().err
    assert "int3" in err and all(name in err for name in KV_CACHE_DTYPES)
    with pytest.raises(ConfigError) as e:
        validate_config({"kv_cache_dtype": "int3"})
    assert all(name in str(e.value.reasons["kv_cache_dtype"]) for name in KV_CACHE_DTYPES)


# --- the kernel -------------------------------------------------------------------------------

def _reference(q, k, v, tables, lens, scale, window):
    """Dequantized pool, gathered per row, masked SDPA."""
    n, kvh, g, d = q.shape
    bs = k.shape[1]
    out = torch.empty_like(q)
    for r in range(n):
        table = tables[r if tables.shape[0] > 1 else 0]
        length = int(lens[r])
        slots = torch.cat([torch.arange(b * bs, b * bs + bs) for b in table.tolist()])[:length]
        if window:
            slots = slots[max(0, length - window):]
        ks = k.reshape(-1, kvh, d)[slots].transpose(0, 1)     # (KVH, L, d)
        vs = v.reshape(-1, kvh, d)[slots].transpose(0, 1)
        out[r] = F.scaled_dot_product_attention(q[r], ks, vs, scale=scale)
    return out


# head_dim 64 / 128 take the fixed-shape path, 32 and 48 the plain loops.
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("kvh,g,d", [(3, 3, 64), (2, 1, 64), (1, 2, 128), (2, 2, 32),
                                     (1, 3, 48)])
@pytest.mark.parametrize("window,shared", [(0, False), (6, False), (0, True)])
def test_kernel_reads_quantized_blocks_as_dequantize_then_sdpa(each_kernel, name, kvh, g, d,
                                                              window, shared):
    fmt = kv_quant.kv_format(name)
    gen = torch.Generator().manual_seed(kvh * 1000 + g * 100 + d + window)
    nb, bs = 41, 8
    layer = kv_quant.allocate(fmt, 1, nb, bs, kvh, d, torch.float32, torch.device("cpu"))[0]
    k = torch.randn(nb * bs, kvh, d, generator=gen) * 2 + 0.3
    v = torch.randn(nb * bs, kvh, d, generator=gen)
    kv_quant.write(fmt, layer, torch.arange(nb * bs), k, v)
    assert layer.k.dtype == fmt.data_dtype   # stored quantized, in the pool
    lens = torch.tensor([1, 8, 9, 30, 57, 3])
    tables = torch.randint(0, nb, (1 if shared else len(lens), 8), generator=gen)
    q = torch.randn(len(lens), kvh, g, d, generator=gen)
    out = torch.empty_like(q)
    each_kernel.paged_decode_attention_quant(q, layer.k, layer.v, layer.k_params,
                                             layer.v_params, tables, lens, d ** -0.5, window,
                                             fmt.bits, out)
    kd = kv_quant.dequantize(fmt, layer.k, layer.k_params)
    vd = kv_quant.dequantize(fmt, layer.v, layer.v_params)
    want = _reference(q, kd, vd, tables, lens, d ** -0.5, window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_kernel_refuses_mismatched_quantized_pools(kernel):
    fmt = kv_quant.kv_format("int4_per_token_head")
    layer = kv_quant.allocate(fmt, 1, 4, 4, 2, 8, torch.float32, torch.device("cpu"))[0]
    q = torch.randn(2, 2, 1, 8)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="int8 data"):   # int4 data read as int8
        kernel.paged_decode_attention_quant(q, layer.k, layer.v, layer.k_params,
                                            layer.v_params, tables, lens, 1.0, 0, 8,
                                            torch.empty_like(q))
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.paged_decode_attention_quant(q, layer.k, layer.v, layer.k_params,
                                            layer.v_params, tables + 9, lens, 1.0, 0, 4,
                                            torch.empty_like(q))


# --- a real engine ----------------------------------------------------------------------------

PROMPTS = [[(7 * i + j * 3) % 200 + 5 for j in range(20 + 13 * i)] for i in range(8)]
NEAR_TIE = 0.25   # top-2 logprob gap of `auto` under which int8's rounding may pick the other


def _engine(kv_cache_dtype: str, **kw) -> EngineCore:
    values = {"model": "tiny", "device": "cpu", "dtype": "float32", "max_num_seqs": 8,
              "max_num_batched_tokens": 40, "num_kv_blocks": 64, **kw}
    return EngineCore(EngineConfig(kv_cache_dtype=kv_cache_dtype, **values))


def test_greedy_int8_equals_auto_on_tiny_but_at_named_near_ties():
    """Chunked prefills read quantized context, decodes read quantized blocks; each prompt's
    tokens equal auto's, or part from them where auto's top two were within NEAR_TIE."""
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    auto = _engine("auto")
    base = run_batch(auto, [auto.make_request(f"r{i}", prompt_token_ids=p, sampling=sp)
                            for i, p in enumerate(PROMPTS)])
    core = _engine("int8")
    assert core.runner.kv_caches[0].k.dtype == torch.int8
    got = run_batch(core, greedy_requests(core, PROMPTS, 24, ignore_eos=True)).output_token_ids
    equal = 0
    for want, lps, tokens in zip(base.output_token_ids, base.outputs, got, strict=True):
        assert len(tokens) == len(want) == 24
        step = next((s for s, (a, b) in enumerate(zip(want, tokens, strict=True))
                     if a != b), None)
        if step is None:
            equal += 1
            continue
        _, _, top = lps.logprobs[step]
        assert top[0] - top[1] < NEAR_TIE, f"parted at step {step}, auto's gap {top}"
    assert equal >= len(PROMPTS) // 2


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler: no kernel to compare")
@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_kernel_and_torch_reader_agree_on_every_step(kernel, name, monkeypatch):
    """Every kernel call of a real run (decode groups and prefill chunks over quantized
    context) checked against the torch path's reader on the same pool: gather, dequantize,
    SDPA."""
    seen = {"decode": 0.0, "prefill": 0.0}
    calls = {"decode": 0, "prefill": 0}
    run_kernel = paged_attention._kernel

    def checked(meta, layer, q, tables, lens, scale, window, out):
        run_kernel(meta, layer, q, tables, lens, scale, window, out)
        n, kvh, _, d = q.shape
        want = torch.empty_like(q)
        for r in range(n):
            table = tables[r if tables.shape[0] > 1 else 0]
            length = int(lens[r])
            ks, vs = paged_attention._gather_blocks(
                meta, layer, table[:-(-length // meta.block_size)].contiguous(), torch.float32)
            ks = ks.reshape(-1, kvh, d)[:length].transpose(0, 1)
            vs = vs.reshape(-1, kvh, d)[:length].transpose(0, 1)
            want[r] = F.scaled_dot_product_attention(q[r], ks, vs, scale=scale)
        kind = "prefill" if tables.shape[0] == 1 and n > 1 else "decode"
        seen[kind] = max(seen[kind], float((want - out).abs().max()))
        calls[kind] += 1

    monkeypatch.setattr(paged_attention, "_kernel", checked)
    core = _engine(name)
    run_batch(core, greedy_requests(core, PROMPTS, 12))
    assert calls["decode"] > 0 and calls["prefill"] > 0
    assert seen["decode"] < 1e-4 and seen["prefill"] < 1e-4


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler: no kernel to compare")
@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_kernel_and_torch_path_agree_on_quantized_blocks(kernel, name, monkeypatch):
    """Greedy tokens with the kernel and with ``VCONSOLE_ATTENTION_KERNEL=torch``: equal for
    the per-token formats. int4_kivi's float16 channel scales turn a last-bit difference of
    the two readers into a rounding one a layer later, so there a prompt may part at a near-tie
    (top two within 1e-3), never elsewhere."""
    tokens = {}
    lps = {}
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    for mode in ("auto", "torch"):
        monkeypatch.setenv(attention_kernel.KERNEL_ENV, mode)
        monkeypatch.setattr(attention_kernel, "_state", {})
        core = _engine(name)
        assert (core.runner._decode_kernel is not None) == (mode == "auto")
        result = run_batch(core, [core.make_request(f"r{i}", prompt_token_ids=p, sampling=sp)
                                  for i, p in enumerate(PROMPTS)])
        tokens[mode], lps[mode] = result.output_token_ids, result.outputs
    if name not in PER_CHANNEL:
        assert tokens["auto"] == tokens["torch"]
        return
    for i, (a, b) in enumerate(zip(tokens["auto"], tokens["torch"], strict=True)):
        step = next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if step is not None:
            top = lps["auto"][i].logprobs[step][2]
            assert top[0] - top[1] < 1e-3, f"prompt {i} parted at step {step}: {top}"


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_prefix_cache_hits_on_quantized_blocks(name):
    """A second request with the same 48-token prefix reuses the stored blocks as they are and
    decodes what a cold engine decodes from the same cached state."""
    prefix = [(11 * j) % 200 + 5 for j in range(48)]
    first, second = prefix + [7, 8, 9], prefix + [10, 11]
    core = _engine(name)
    run_batch(core, greedy_requests(core, [first], 8, ignore_eos=True))
    out = run_batch(core, greedy_requests(core, [second], 8, ignore_eos=True))
    assert out.outputs[0].num_cached_tokens == 48
    # The same again: identical tokens from identical (cached, quantized) blocks.
    again = run_batch(core, greedy_requests(core, [second], 8, ignore_eos=True))
    assert again.outputs[0].num_cached_tokens == 48
    assert again.output_token_ids == out.output_token_ids


def _pool_bytes(core) -> int:
    """What the runner's pool tensors take, each storage once (a per-channel format's K, V and
    staging share one per layer)."""
    seen: dict[int, int] = {}
    for layer in core.runner.kv_caches:
        for t in (layer.k, layer.v, layer.k_params, layer.v_params, layer.k_stage,
                  layer.k_stage_scale):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_capacity_follows_kv_cache_memory_bytes():
    budget = 64 * 16 * _engine("auto", num_kv_blocks=4).runner.kv_bytes_per_token
    blocks = {}
    for name in ("auto", "int8", "int4_per_token_head", "int4_kivi", "int8_kivi"):
        core = _engine(name, num_kv_blocks=None, kv_cache_memory_bytes=budget)
        blocks[name] = core.num_kv_blocks
        per_block = core.runner.kv_cache_bytes_per_block(16)
        assert blocks[name] == budget // per_block        # nothing beside the blocks
        # What is shown is what is allocated: the pool's tensors, staging in them.
        info = core.model_info()
        assert info["kv_pool_bytes"] == per_block * blocks[name] == _pool_bytes(core)
        assert info["kv_staging_bytes"] == 0 == info["kv_staging_blocks"]
        assert info["kv_bytes_per_token"] == core.runner.kv_bytes_per_token
        assert (core.runner.open_blocks is not None) == (name in PER_CHANNEL)
    assert blocks["auto"] == 64
    assert blocks["int8"] >= 3.7 * 64 and blocks["int4_per_token_head"] >= 6.3 * 64
    # Per-channel key parameters per block cost a little; the staging, a block per request.
    assert 5.5 * 64 <= blocks["int4_kivi"] < blocks["int4_per_token_head"]
    assert 3.6 * 64 <= blocks["int8_kivi"] <= blocks["int8"]
    with pytest.raises(ValueError, match="holds no block"):
        _engine("int8", num_kv_blocks=None, kv_cache_memory_bytes=100)


@pytest.mark.parametrize("name", PER_CHANNEL)
def test_capacity_at_a_small_budget_holds_blocks_and_what_is_open(name):
    """A budget of 2 float32 blocks: the per-channel pool holds budget / bytes per block
    blocks (denser than float32), and each running request holds one more block than its
    table for its open block's keys, no more, taken and given back with its table. Two
    requests of 40 and 53 tokens hold 3 + 1 and 4 + 1 blocks at their ends, more than the
    pool: they take turns (preemption) and both finish; at
    every step the lent blocks are the running requests', in no table, and the tables and
    lent blocks together are what the pool has in use."""
    per_auto = 16 * _engine("auto", num_kv_blocks=4).runner.kv_bytes_per_token
    budget = 2 * per_auto
    core = _engine(name, num_kv_blocks=None, kv_cache_memory_bytes=budget, max_num_seqs=4)
    r, kv = core.runner, core.scheduler.kv
    blocks = core.num_kv_blocks
    assert blocks == budget // r.kv_cache_bytes_per_block(16) and blocks >= 7
    assert r.staging_of is kv.staging
    seen = []

    def check(*_) -> None:   # after every step
        running = {q.request_id for q in core.scheduler.running}
        lent = kv.staging
        assert set(lent) == set(kv.tables) and set(lent) <= running | set(kv.tables)
        in_tables = {b for t in kv.tables.values() for b in t}
        assert not in_tables & set(lent.values()) and len(set(lent.values())) == len(lent)
        assert kv.pool.num_used_blocks == len(in_tables) + kv.num_staging_blocks
        seen.append(len(lent))

    reqs = greedy_requests(core, PROMPTS[:2], 20, ignore_eos=True)   # ~15 + 20 tokens each
    out = run_batch(core, reqs, on_progress=check)
    assert [len(t) for t in out.output_token_ids] == [20, 20]
    assert max(seen) >= 1 and kv.num_staging_blocks == 0 and r.open_blocks.early_seals == 0


@pytest.mark.parametrize("budget,seats,int4_min", [(64 << 20, 64, 5.5), (47_185_920, 12, 5.5)])
def test_smollm2_capacity_at_the_issues_budgets(budget, seats, int4_min):
    """SmolLM2's shape (30 layers, 3 KV heads of 64, float32) at 64 MiB and 64 seats, and at the
    demo's budget and 12 seats, as the runner sizes them (`ModelRunner._blocks_in`): the pool's
    blocks, each running request holding one of them for its open block's keys."""
    def blocks(name: str) -> int:
        return budget // kv_quant.kv_format(name).bytes_per_block(16, 30, 3, 64, 4)
    auto = blocks("auto")
    assert blocks("int8") >= 3.7 * auto
    assert blocks("int4_kivi") >= int4_min * auto
    assert blocks("int8_kivi") >= 3.7 * auto
    # With every seat running, the blocks left for tokens: still above 3x and 5x.
    assert blocks("int8_kivi") - seats >= 3.0 * auto and blocks("int4_kivi") - seats >= 5 * auto


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_preemption_on_a_small_quantized_pool_completes_every_request(name):
    """Five requests on 10 blocks: they preempt each other, recompute into quantized blocks
    and all finish with their full length."""
    core = _engine(name, num_kv_blocks=10, max_num_seqs=5)
    result = run_batch(core, greedy_requests(core, PROMPTS[:5], 12, ignore_eos=True))
    assert [len(t) for t in result.output_token_ids] == [12] * 5
    assert core.scheduler.num_preemptions_total > 0


# --- int4_kivi: keys per channel over a block, open blocks staged ------------------------------

class _Lender(dict):
    """The KV manager's side for a bare `OpenBlocks`: lends each new writer one of the
    ``entries`` blocks after the data blocks (``nb ..``), while any is left."""

    def __init__(self, nb: int, entries: int) -> None:
        super().__init__()
        self.free = list(range(nb + entries - 1, nb - 1, -1))

    def lend(self, owner: str) -> None:
        if owner not in self and self.free:
            self[owner] = self.free.pop()

    def give_back(self, owner: str) -> None:
        self.free.append(self.pop(owner))


def _kivi_layer(nb: int, bs: int, kvh: int, d: int, entries: int, name: str = "int4_kivi"):
    """A pool of ``nb`` data blocks plus ``entries`` blocks to lend as staging."""
    fmt = kv_quant.kv_format(name)
    layer = kv_quant.allocate(fmt, 1, nb + entries, bs, kvh, d, torch.float32,
                              torch.device("cpu"))[0]
    blocks = OpenBlocks(nb + entries, bs, torch.device("cpu"))
    blocks.lender = _Lender(nb, entries)
    return fmt, layer, blocks


def _plan(blocks, plan_in, live):
    for w in plan_in:
        if w[4] in live and w[2] < blocks.block_size:   # a writer left with an open block
            blocks.lender.lend(w[4])
    return blocks.plan(plan_in, live, blocks.lender)


def _step(fmt, layer, blocks, writes, keys, bs, live=None):
    """Write rows ``keys[block][lo:hi]`` for each (block, lo, hi) as one step."""
    rows, slots, plan_in = [], [], []
    for block, lo, hi in writes:
        plan_in.append((block, lo, hi, len(rows), f"req-of-{block}"))
        rows.extend(keys[block][lo:hi])
        slots.extend(range(block * bs + lo, block * bs + hi))
    k = torch.stack(rows)
    plan = _plan(blocks, plan_in, live if live is not None else [w[4] for w in plan_in])
    kv_quant.write_per_channel(fmt, layer, plan, torch.tensor(slots), k, k.clone())
    return plan


def _staged_close(got: torch.Tensor, want: torch.Tensor, name: str = "int4_kivi") -> bool:
    """The staging's code: int4_kivi's int8 per row (within half a step of the row's largest
    value / 127), int8_kivi's float16 (relative to each value)."""
    if kv_quant.kv_format(name).stage_int8:
        step = want.abs().amax(-1, keepdim=True) / 127
        return bool(((got - want).abs() <= step / 2 * 1.001 + 1e-7).all())
    return torch.equal(got, want.half().float())


@pytest.mark.parametrize("name", PER_CHANNEL)
def test_staging_round_trip_and_the_values_float16_parameters(name):
    """The per-channel formats' new groupings: staged key rows come back within their code's
    error (int4_kivi: int8 per row, zero rows exact; int8_kivi: float16), and the values,
    whose parameters are float16, within half a step of the parameters as stored."""
    fmt = kv_quant.kv_format(name)
    layer = kv_quant.allocate(fmt, 1, 20, 16, 3, 64, torch.float32, torch.device("cpu"))[0]
    assert layer.k_stage.dtype == (torch.int8 if fmt.stage_int8 else torch.float16)
    # Staging is the pool's own bytes (an entry per block, lent by the KV manager): no more.
    assert layer.k_stage.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()
    assert layer.k_stage.shape == (20, 16, 3, 64)
    assert layer.v_params.dtype == torch.float16
    x = _rows(2)
    rows = torch.randperm(20 * 16)[:x.shape[0]]
    kv_quant.stage_rows(layer, rows, x)
    back = kv_quant.staged_rows(layer, rows)
    assert _staged_close(back, x, name) and (back[::50] == 0).all()
    if fmt.stage_int8:   # the outlier channel sets the row's step: finer than int4's per channel
        assert layer.k_stage_scale.shape == (20, 16, 3, 1)
    data, params = kv_quant.quantize(fmt, x, torch.float16)
    assert params.dtype == torch.float16
    vals = kv_quant.dequantize(fmt, data, params)
    p = params.float()
    step = p[..., :1]
    assert ((vals - x).abs() <= step / 2 * 1.001 + 1e-6).all()
    # The stored parameters are float16's: the step is within float16's rounding of float32's.
    torch.testing.assert_close(step, kv_quant.quantize(fmt, x)[1][..., :1], rtol=2e-3, atol=0)


def test_open_blocks_are_staged_in_int8_and_sealed_per_channel_when_full():
    bs, kvh, d = 8, 2, 16
    fmt, layer, blocks = _kivi_layer(6, bs, kvh, d, entries=4)
    gen = torch.Generator().manual_seed(3)
    keys = {b: torch.randn(bs, kvh, d, generator=gen) * torch.linspace(0.1, 9, d) for b in (1, 4)}
    _step(fmt, layer, blocks, [(1, 0, 5), (4, 0, 1)], keys, bs)       # a chunk and a decode
    assert blocks.num_open == 2
    got = kv_quant.read_keys(layer, torch.tensor([1, 4]), blocks.entry_of)
    assert _staged_close(got[0, :5], keys[1][:5]) and _staged_close(got[1, :1], keys[4][:1])
    for t in range(1, bs):                                             # block 4 decodes to full
        plan = _step(fmt, layer, blocks, [(4, t, t + 1)], keys, bs, ["req-of-1", "req-of-4"])
    assert plan.seal_blocks.tolist() == [4] and blocks.entry_of[4] == -1
    assert blocks.num_open == 1 and blocks.entry_of[1] >= 0
    got = kv_quant.read_keys(layer, torch.tensor([4]), blocks.entry_of)[0]
    # Per channel: within half a step of that channel's range over the block, small channels
    # as well as large ones, plus the staged rows' int8 half step (a 20th of int4's at most).
    step = (keys[4].amax(0) - keys[4].amin(0)) / 15
    staged = keys[4].abs().amax(-1, keepdim=True) / 254
    assert ((got - keys[4]).abs() <= step / 2 * 1.01 + staged + 1e-3).all()
    assert layer.k.dtype == torch.uint8 and layer.k_params.dtype == torch.float16


def test_a_request_without_a_lent_block_is_sealed_early_and_reopened_on_its_next_write():
    """Three live requests decoding, two lent blocks (a runner stepped without a KV manager
    lends none): the third's block never takes another's entry; it is rounded early each step
    and re-opened on the next, and all three end within one 4-bit step of each channel's
    range."""
    bs, kvh, d = 8, 1, 16
    fmt, layer, blocks = _kivi_layer(8, bs, kvh, d, entries=2)
    gen = torch.Generator().manual_seed(5)
    keys = {b: torch.randn(bs, kvh, d, generator=gen) for b in range(8)}
    live = [f"req-of-{b}" for b in (0, 1, 2)]
    for t in range(bs):
        _step(fmt, layer, blocks, [(b, t, t + 1) for b in (0, 1, 2)], keys, bs, live)
        assert blocks.num_open <= 2
        if t < bs - 1:
            assert blocks.entry_of[0] >= 0 and blocks.entry_of[1] >= 0   # kept their entries
            assert blocks.entry_of[2] == -1
    assert blocks.early_seals == bs - 1
    got = kv_quant.read_keys(layer, torch.tensor([0, 1, 2]), blocks.entry_of)
    want = torch.stack([keys[b] for b in (0, 1, 2)])
    step = (want.amax(1, keepdim=True) - want.amin(1, keepdim=True)) / 15
    staged = want.abs().amax(-1, keepdim=True) / 254         # the int8 staging's half step
    assert ((got[:2] - want[:2]).abs() <= step[:2] / 2 * 1.01 + staged[:2] + 1e-3).all()
    assert ((got - want).abs() <= step * 1.05 + staged + 1e-3).all()
    assert all(blocks.entry_of[b] == -1 for b in (0, 1, 2))


def test_a_gone_requests_open_block_is_dropped_and_its_lent_block_serves_another():
    """Request 0 finishes with its block open: the KV manager takes its lent block back and
    lends it to request 1, whose keys are staged there; the plan forgets block 0 without
    moving a row (its entry is another's now, its block free) and seals nothing."""
    bs = 8
    fmt, layer, blocks = _kivi_layer(4, bs, 1, 16, entries=1)
    keys = {b: torch.randn(bs, 1, 16) for b in range(4)}
    _step(fmt, layer, blocks, [(0, 0, 3)], keys, bs, live=["req-of-0"])
    lent = blocks.lender["req-of-0"]
    assert blocks.entry_of[0] == lent
    blocks.lender.give_back("req-of-0")
    plan = _step(fmt, layer, blocks, [(1, 0, 2)], keys, bs, live=["req-of-1"])
    assert plan.seal_blocks.tolist() == [] and plan.work_from_stage[0].numel() == 0
    assert blocks.entry_of[0] == -1 and blocks.entry_of[1] == lent == blocks.lender["req-of-1"]
    assert blocks.num_open == 1 and blocks.early_seals == 0
    got = kv_quant.read_keys(layer, torch.tensor([1]), blocks.entry_of)[0]
    assert _staged_close(got[:2], keys[1][:2])


def test_one_lent_block_per_request_holds_every_open_block_when_blocks_fill_and_open():
    """Staging sized by what is open: a request has one open block at most, so two requests
    need two lent blocks even in a step where both fill a block and open the next (listed
    open first: the plan seals before it opens). Nothing is sealed early."""
    bs = 4
    fmt, layer, blocks = _kivi_layer(6, bs, 1, 16, entries=2)
    gen = torch.Generator().manual_seed(0)
    keys = {b: torch.randn(bs, 1, 16, generator=gen) for b in range(6)}
    live = ["a", "b"]

    def step(writes):   # (block, lo, hi, owner)
        rows, slots, plan_in = [], [], []
        for block, lo, hi, owner in writes:
            plan_in.append((block, lo, hi, len(rows), owner))
            rows.extend(keys[block][lo:hi])
            slots.extend(range(block * bs + lo, block * bs + hi))
        k = torch.stack(rows)
        kv_quant.write_per_channel(fmt, layer, _plan(blocks, plan_in, live),
                                   torch.tensor(slots), k, k.clone())

    step([(0, 0, 3, "a"), (1, 0, 3, "b")])
    step([(2, 0, 2, "a"), (3, 0, 1, "b"), (0, 3, 4, "a"), (1, 3, 4, "b")])
    assert blocks.early_seals == 0 and blocks.num_open == 2
    assert blocks.entry_of[2] == blocks.lender["a"] and blocks.entry_of[3] == blocks.lender["b"]
    assert blocks.entry_of[0] == -1 and blocks.entry_of[1] == -1
    # Each row within half a step of its channel's range, plus its own staged int8 half step
    # (the row's largest value / 254: keepdim, or row i is held to row j's staging bound).
    for b in (0, 1):
        step4 = ((keys[b].amax(0) - keys[b].amin(0)) / 15 / 2
                 + keys[b].abs().amax(-1, keepdim=True) / 254)
        got = kv_quant.read_keys(layer, torch.tensor([b]), blocks.entry_of)[0]
        assert got.shape == step4.shape
        assert ((got - keys[b]).abs() <= step4 * 1.01 + 1e-3).all()


def test_a_resumed_request_drops_the_block_its_preemption_left_open():
    """Preempted, a request's blocks (its lent one too) are freed but its open block is still
    listed; when it runs again (the same id, live, a new lent block) and opens a block, the
    old one is dropped and the new one staged in its new lent block."""
    bs = 4
    fmt, layer, blocks = _kivi_layer(4, bs, 1, 16, entries=2)
    keys = {b: torch.randn(bs, 1, 16) for b in range(4)}
    _step(fmt, layer, blocks, [(0, 0, 3)], keys, bs, live=["req-of-0"])
    blocks.lender.give_back("req-of-0")
    blocks.lender.free.reverse()                      # it comes back with the other block
    plan = _plan(blocks, [(2, 0, 2, 0, "req-of-0")], ["req-of-0"])   # resumed on block 2
    assert plan.seal_blocks.tolist() == [] and blocks.entry_of[0] == -1
    assert blocks.entry_of[2] == blocks.lender["req-of-0"]
    assert blocks.early_seals == 0 and blocks.num_open == 1


def test_a_block_restarting_from_offset_zero_drops_its_old_rows():
    bs = 4
    fmt, layer, blocks = _kivi_layer(3, bs, 1, 16, entries=2)
    old = {2: torch.full((bs, 1, 16), 7.0)}
    new = {2: torch.randn(bs, 1, 16)}
    _step(fmt, layer, blocks, [(2, 0, 2)], old, bs)          # freed while open, then reused
    _step(fmt, layer, blocks, [(2, 0, 1)], new, bs)
    got = kv_quant.read_keys(layer, torch.tensor([2]), blocks.entry_of)[0]
    assert _staged_close(got[:1], new[2][:1])
    _step(fmt, layer, blocks, [(2, 1, bs)], new, bs)          # and fills: no 7.0 in its range
    got = kv_quant.read_keys(layer, torch.tensor([2]), blocks.entry_of)[0]
    assert got.max() < 6.0


def test_int8_kivi_seals_keys_per_channel_within_half_a_step_of_each_channel():
    """int8_kivi: an open block's keys staged in float16; sealed, each channel within half a
    step of its own range (max |x| / 127 over the block), the small channels as well as the
    outlier one, which under one scale per token and head would set every channel's step."""
    bs, kvh, d = 8, 2, 16
    fmt, layer, blocks = _kivi_layer(4, bs, kvh, d, entries=2, name="int8_kivi")
    gen = torch.Generator().manual_seed(7)
    keys = {1: torch.randn(bs, kvh, d, generator=gen) * torch.linspace(0.05, 1, d)}
    keys[1][:, :, 3] *= 40.0                                          # an outlier channel
    _step(fmt, layer, blocks, [(1, 0, 5)], keys, bs)
    got = kv_quant.read_keys(layer, torch.tensor([1]), blocks.entry_of)[0]
    assert _staged_close(got[:5], keys[1][:5], "int8_kivi")
    _step(fmt, layer, blocks, [(1, 5, bs)], keys, bs)
    assert blocks.entry_of[1] == -1 and layer.k.dtype == torch.int8
    assert layer.k_params.shape == (4 + 2, kvh, 1, d) and layer.k_params.dtype == torch.float16
    got = kv_quant.read_keys(layer, torch.tensor([1]), blocks.entry_of)[0]
    step = keys[1].abs().amax(0) / 127                                # (KVH, D) per channel
    # Half a step, plus float16's rounding of the staged rows (2^-11 of a value: at most 127
    # steps) and of the stored scale.
    assert ((got - keys[1]).abs() <= step * (0.5 * 1.001 + 127 / 2048)).all()
    # Against one scale per token and head on the same keys: the other channels' error is a
    # fraction of what the outlier channel's scale gave them.
    per_token = kv_quant.kv_format("int8_per_token_head")
    again = kv_quant.dequantize(per_token, *kv_quant.quantize(per_token, keys[1]))
    small = torch.ones(d, dtype=torch.bool)
    small[3] = False
    err, err_token = ((x - keys[1]).abs()[..., small].mean() for x in (got, again))
    assert err < err_token / 4


# head_dim 64 takes the fixed-shape path, 48 the plain loops.
@pytest.mark.parametrize("name", PER_CHANNEL)
@pytest.mark.parametrize("kvh,g,d", [(3, 3, 64), (2, 2, 48)])
def test_kernel_reads_kivi_blocks_sealed_and_open(each_kernel, name, kvh, g, d):
    bs, nb = 8, 12
    fmt, layer, blocks = _kivi_layer(nb, bs, kvh, d, entries=4, name=name)
    gen = torch.Generator().manual_seed(11)
    keys = {b: torch.randn(bs, kvh, d, generator=gen) + torch.linspace(-4, 4, d)
            for b in range(nb)}
    _step(fmt, layer, blocks, [(b, 0, bs) for b in range(8)] + [(9, 0, 3), (10, 0, 5)], keys,
          bs)
    assert blocks.entry_of[9] >= 0 and blocks.entry_of[2] == -1
    tables = torch.tensor([[0, 1, 9, 0], [2, 3, 4, 10], [7, 0, 0, 0]])
    lens = torch.tensor([19, 29, 6])
    q = torch.randn(3, kvh, g, d, generator=gen)
    for window, shared in ((0, False), (5, False), (0, True)):
        t = tables[:1].contiguous() if shared else tables
        ln = torch.tensor([19, 12, 3]) if shared else lens
        out = torch.empty_like(q)
        each_kernel.paged_decode_attention_kivi(q, layer.k, layer.v, layer.k_params,
                                                layer.v_params, layer.k_stage,
                                                layer.k_stage_scale, blocks.entry_of,
                                                t, ln, d ** -0.5, window, out)
        kd = kv_quant.read_keys(layer, torch.arange(nb), blocks.entry_of)
        vd = kv_quant.dequantize(fmt, layer.v, layer.v_params)
        want = _reference(q, kd, vd, t, ln, d ** -0.5, window)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    # K and V are the halves of one slot's bytes; a V laid out otherwise is refused.
    assert not layer.k.is_contiguous() and layer.k.stride() == layer.v.stride()
    with pytest.raises(RuntimeError, match="K and V data"):
        each_kernel.paged_decode_attention_kivi(q, layer.k, layer.v.contiguous(),
                                                layer.k_params, layer.v_params, layer.k_stage,
                                                layer.k_stage_scale, blocks.entry_of, tables,
                                                lens, d ** -0.5, 0, torch.empty_like(q))


def test_kv_events_are_the_same_on_quantized_blocks():
    """Storage does not enter a block's hash: the same prompts give the same BlockStored
    events (hashes, tokens, parents) on auto and on int4_kivi blocks (one output token each,
    so that the blocks are the prompts' and not the models' diverging outputs)."""
    events = {}
    for name in ("auto", "int4_kivi"):
        core = _engine(name, num_kv_blocks=128)
        core.scheduler.kv.enable_events()
        run_batch(core, greedy_requests(core, PROMPTS, 1, ignore_eos=True))
        events[name] = [(type(e).__name__, getattr(e, "block_hashes", None),
                         getattr(e, "parent_block_hash", None), getattr(e, "token_ids", None))
                        for e in core.scheduler.kv.take_events()]
    assert events["auto"] and events["auto"] == events["int4_kivi"]


@pytest.mark.parametrize("name", ("int8", "int4_kivi"))
def test_bfloat16_torch_path_reads_quantized_blocks(name):
    """The path a CUDA engine takes (bfloat16 model: no CPU kernel), here on the CPU: it
    generates, and a cached prefix is reused as stored (two cached runs agree; a cold run
    attends over its first chunk's unrounded K/V, so it may not)."""
    core = _engine(name, dtype="bfloat16")
    assert core.runner._decode_kernel is None and core.runner.dtype == torch.bfloat16
    assert core.runner.kv_caches[0].k.dtype in (torch.int8, torch.uint8)
    prompt = [(13 * j) % 200 + 5 for j in range(40)] + [1, 2]
    first = run_batch(core, greedy_requests(core, [prompt], 10, ignore_eos=True))
    assert len(first.output_token_ids[0]) == 10
    second = run_batch(core, greedy_requests(core, [prompt], 10, ignore_eos=True))
    third = run_batch(core, greedy_requests(core, [prompt], 10, ignore_eos=True))
    assert second.outputs[0].num_cached_tokens == third.outputs[0].num_cached_tokens == 32
    assert third.output_token_ids == second.output_token_ids


@pytest.mark.parametrize("name,params_dtype", [
    *((n, torch.float32) for n in QUANTIZED), *((n, torch.float16) for n in QUANTIZED)])
def test_the_kernels_quantize_store_writes_what_torch_quantize_does(each_kernel, name,
                                                                    params_dtype):
    """The engine's CPU write (one kernel call per K and V per layer) against `quantize`:
    the same parameters, the same codes but for a rare rounding tie (at most one step); with
    float16 parameters (a per-channel pool's values) as well as float32."""
    fmt = kv_quant.kv_format(name)
    x = _rows(7)
    slots = torch.randperm(20 * 16)[:x.shape[0]]
    layer = kv_quant.allocate(fmt, 1, 20, 16, 3, 64, torch.float32, torch.device("cpu"))[0]
    layer.k_params = layer.k_params.to(params_dtype)
    each_kernel.quantize_store(x, slots, layer.k, layer.k_params, fmt.bits)
    q, p = kv_quant.quantize(fmt, x, params_dtype)
    got_q = layer.k.view(-1, 3, q.shape[-1])[slots]
    got_p = layer.k_params.view(-1, 3, fmt.params)[slots]
    torch.testing.assert_close(got_p, p, rtol=1e-6, atol=0)
    back = kv_quant.dequantize(fmt, got_q, got_p)
    assert ((back - x).abs() <= kv_quant.bound(fmt, x) * 1.001 + 1e-6).all()
    assert (kv_quant.dequantize(fmt, q, p) - back).abs().max() <= float(p[..., 0].max()) + 1e-6
    with pytest.raises(RuntimeError, match="outside the pool"):
        each_kernel.quantize_store(x, slots + 10_000, layer.k, layer.k_params, fmt.bits)


@pytest.mark.parametrize("name", PER_CHANNEL)
def test_the_kernels_quantize_store_writes_the_values_half_of_a_per_channel_pool(each_kernel,
                                                                                name):
    """A per-channel pool's V is the second half of each slot's bytes: the kernel's write
    puts what torch's does there, and leaves the K half (another block's staging, maybe)
    untouched."""
    fmt = kv_quant.kv_format(name)
    x = _rows(9)
    slots = torch.randperm(20 * 16)[:x.shape[0]]
    layers = [kv_quant.allocate(fmt, 1, 20, 16, 3, 64, torch.float32, torch.device("cpu"))[0]
              for _ in range(2)]
    for layer in layers:
        layer.k.fill_(7)
    each_kernel.quantize_store(x, slots, layers[0].v, layers[0].v_params, fmt.bits)
    kv_quant._store_rows(fmt, layers[1].v, layers[1].v_params, slots, x, None)
    torch.testing.assert_close(layers[0].v_params, layers[1].v_params, rtol=1e-3, atol=0)
    back = [kv_quant.dequantize(fmt, la.v, la.v_params) for la in layers]
    assert (back[0] - back[1]).abs().max() <= float(layers[1].v_params[..., 0].float().max())
    assert back[1].view(-1, 3, 64)[slots].abs().max() > 0
    assert (layers[0].k == 7).all()
