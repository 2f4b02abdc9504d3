"""The compiled CPU decode-attention kernel against the torch path it replaces (gather the blocks,
then SDPA with a length mask), and the engine using it.

Shapes cover what the engine sends: GQA folds of 1, 2 and 4 query heads per KV head, contexts of
one token, exactly a block, and many blocks scattered over the pool, sliding windows shorter and
longer than the context, and padded block tables (entries past a row's length are never read:
they point past the pool here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.cxx import HAVE_CXX
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import greedy_requests, run_batch
from vconsole.engine.worker import attention_kernel
from vconsole.shared.config import EngineConfig

if not HAVE_CXX:
    pytest.skip("no C++ compiler on this machine: the engine runs the torch path",
                allow_module_level=True)


def _reference(q, k_pool, v_pool, tables, lens, scale, window):
    n, kvh, g, d = q.shape
    bs = k_pool.shape[1]
    mb = tables.shape[1]
    safe = tables.clamp(max=k_pool.shape[0] - 1)
    ks = k_pool[safe.reshape(-1)].view(n, mb * bs, kvh, d).transpose(1, 2)
    vs = v_pool[safe.reshape(-1)].view(n, mb * bs, kvh, d).transpose(1, 2)
    kpos = torch.arange(mb * bs)
    keep = kpos[None, :] < lens[:, None]
    if window:
        keep &= kpos[None, :] >= (lens - window)[:, None]
    mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))[:, None, None, :]
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scale)


# head_dim 64 and 128 take the kernel's fixed-shape path (SmolLM2's 3 KV heads x 3 queries
# among them), 32 and 16 its plain loops.
@pytest.mark.parametrize("kvh,g,d", [(2, 1, 64), (2, 2, 64), (3, 3, 64), (1, 2, 128),
                                     (1, 4, 32), (4, 2, 16)])
@pytest.mark.parametrize("window", [0, 5, 1000])
def test_equals_gather_and_sdpa(each_kernel, kvh, g, d, window):
    gen = torch.Generator().manual_seed(kvh * 100 + g * 10 + d + window)
    num_blocks, bs = 97, 8
    k_pool = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    v_pool = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    lens = torch.tensor([1, 8, 9, 16, 57, 200, 3, 64])
    mb = int((lens.max() + bs - 1) // bs)
    tables = torch.randint(0, num_blocks, (len(lens), mb), generator=gen)
    for r, n in enumerate(lens.tolist()):  # padding past the context: never read
        tables[r, (n + bs - 1) // bs:] = num_blocks + 10_000
    q = torch.randn(len(lens), kvh, g, d, generator=gen)
    out = torch.empty_like(q)
    each_kernel.paged_decode_attention(q, k_pool, v_pool, tables, lens, d ** -0.5, window, out)
    want = _reference(q, k_pool, v_pool, tables, lens, d ** -0.5, window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_handle(kernel):
    q = torch.randn(2, 2, 2, 8)
    pool = torch.randn(4, 4, 2, 8)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_decode_attention(q.double(), pool, pool, tables, lens, 1.0, 0,
                                      torch.empty_like(q).double())
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.paged_decode_attention(q.transpose(1, 2), pool, pool, tables, lens, 1.0, 0,
                                      torch.empty_like(q))
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.paged_decode_attention(q, pool, pool, tables + 4, lens, 1.0, 0,
                                      torch.empty_like(q))


def test_the_engine_decodes_through_it_and_matches_the_torch_path(kernel, monkeypatch, tmp_path):
    """Same greedy tokens with the kernel and with ``VCONSOLE_ATTENTION_KERNEL=torch``; the
    kernel is what the runner handed the attention."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(10)]
    tokens = {}
    for mode in ("auto", "torch"):
        monkeypatch.setenv(attention_kernel.KERNEL_ENV, mode)
        monkeypatch.setattr(attention_kernel, "_state", {})
        core = EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                       max_num_seqs=10, max_num_batched_tokens=64))
        assert (core.runner._decode_kernel is not None) == (mode == "auto")
        tokens[mode] = run_batch(core, greedy_requests(core, prompts, 12)).output_token_ids
    assert tokens["auto"] == tokens["torch"]
