"""GGUF quantized weights read as stored (``csrc/gguf_gemm.cpp``, `gguf_linear`, issue #47).

On every vector path this CPU can run (native: AVX-512 here; AVX2 forced with ``-mno-avx512f``;
the generic vectors forced with ``-mno-avx2``) and for each quant type read (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K): the kernel's decoding equals the ``gguf`` package's dequantization (the reference
transformers' float path uses) to one rounding, and its linear equals ``x @ W.T`` over those
float weights to float rounding, for the GEMV's 1-8 rows and the GEMM's more, with rows and
channels that fill no whole tile. A model's greedy tokens on the gguf path equal the float
path's for the same file; a file with a quant type not read is refused naming the supported
ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vconsole.engine.worker import gguf_linear, weight_quant
from vconsole.engine.worker.gguf_linear import SUPPORTED, GGUFLinear

# The kernels' float32 sums against the float64 reference, relative to the sum of the
# products' magnitudes (measured: at most 1.1e-7 at K = 768).
SUM_RTOL = 1e-5


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) blocks of type ``qtype``: float weights quantized by the ``gguf``
    package where it can (Q4_0, Q4_1, Q8_0), else random quants under scales of a size a
    model has (Q4_K, Q6_K)."""
    import gguf

    per, size = gguf_linear.BLOCKS[qtype]
    if qtype in (SUPPORTED["Q4_0"], SUPPORTED["Q4_1"], SUPPORTED["Q8_0"]):
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).reshape(n, -1)
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)

    def scales(lo: float, hi: float) -> np.ndarray:
        f = rng.uniform(lo, hi, (n, k // per)).astype(np.float16)
        return f.view(np.uint8).reshape(n, k // per, 2)

    if qtype == SUPPORTED["Q4_K"]:
        raw[..., 0:2] = scales(1e-4, 2e-3)       # d
        raw[..., 2:4] = scales(1e-4, 2e-3)       # dmin
    else:
        raw[..., 208:210] = scales(1e-5, 2e-4)   # d (times int8 scales)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: int) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(
        raw.shape[0], -1)


def test_each_build_names_its_vector_path(path_kernel):
    name, kernel = path_kernel
    flags = weight_quant.cpu_flags()
    want = {"native": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
            else "generic", "avx2": "avx2", "generic": "generic"}[name]
    assert kernel.int8_gemm_isa() == want
    assert gguf_linear.vector_path() == want


@pytest.mark.parametrize("type_name", list(SUPPORTED))
def test_decoding_equals_the_gguf_packages_dequantization(path_kernel, type_name):
    qtype = SUPPORTED[type_name]
    rng = np.random.default_rng(qtype)
    raw = random_blocks(qtype, 37, 512, rng)
    lin = GGUFLinear(torch.from_numpy(raw.copy()), qtype, 512)
    got = lin.dequantized_weight().numpy()
    want = reference(raw, qtype)
    assert np.abs(want).max() > 0.01            # weights of a size, not zeros
    # one rounding apart at most (a fused multiply-add against a product then a sum)
    assert (np.abs(got - want) <= 2.0 ** -23 * np.abs(want) + 1e-30).all()


@pytest.mark.parametrize("type_name", list(SUPPORTED))
@pytest.mark.parametrize("m,n,k", [(1, 40, 512), (2, 33, 256), (3, 17, 768), (4, 64, 256),
                                   (5, 50, 512), (8, 45, 256), (9, 21, 512), (13, 70, 256),
                                   (130, 37, 512)])
def test_the_linear_equals_the_float_reference_to_rounding(path_kernel, type_name, m, n, k):
    """1-8 rows: the GEMV (rows 5-8 in a second pass on 8-lane vectors); 9 and more: the GEMM,
    with rows and channels that fill no whole micro-kernel, panel or row block."""
    qtype = SUPPORTED[type_name]
    rng = np.random.default_rng(m * 1000 + n)
    raw = random_blocks(qtype, n, k, rng)
    w = torch.from_numpy(reference(raw, qtype)).double()
    bias = torch.randn(n)
    lin = GGUFLinear(torch.from_numpy(raw.copy()), qtype, k, bias)
    x = torch.randn(m, k) * 2
    got = lin(x[None])                             # leading axes kept
    assert got.shape == (1, m, n) and got.dtype == torch.float32
    want = x.double() @ w.t() + bias.double()
    bound = SUM_RTOL * (x.double().abs() @ w.abs().t()) + 1e-6
    assert ((got[0].double() - want).abs() <= bound).all()


def test_stacked_linears_equal_the_parts_side_by_side(path_kernel):
    rng = np.random.default_rng(7)
    qtype = SUPPORTED["Q4_1"]
    parts = [GGUFLinear(torch.from_numpy(random_blocks(qtype, n, 256, rng).copy()), qtype, 256)
             for n in (24, 8, 8)]
    fused = GGUFLinear.concat(parts)
    for rows in (1, 9):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1),
                                   rtol=0, atol=0)
    other = GGUFLinear(torch.from_numpy(random_blocks(SUPPORTED["Q8_0"], 8, 256, rng).copy()),
                       SUPPORTED["Q8_0"], 256)
    with pytest.raises(ValueError, match="one quant type"):
        GGUFLinear.concat([parts[0], other])


def test_bad_blocks_are_refused(path_kernel):
    _, kernel = path_kernel
    qtype = SUPPORTED["Q4_0"]
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0, Q4_K, Q6_K"):
        GGUFLinear(torch.zeros(4, 18, dtype=torch.uint8), 6, 32)        # Q5_0
    with pytest.raises(ValueError, match="whole blocks of 256"):
        GGUFLinear(torch.zeros(4, 144, dtype=torch.uint8), SUPPORTED["Q4_K"], 96)
    with pytest.raises(ValueError, match=r"\(N, 36\) uint8"):
        GGUFLinear(torch.zeros(4, 35, dtype=torch.uint8), qtype, 64)
    blocks, out = torch.zeros(4, 36, dtype=torch.uint8), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="not a whole number of blocks of 32"):
        kernel.gguf_linear(torch.zeros(2, 48), blocks, qtype, out)
    with pytest.raises(RuntimeError, match="not one this kernel reads"):
        kernel.gguf_linear(torch.zeros(2, 64), blocks, 6, out)
    with pytest.raises(RuntimeError, match="float32 x and out"):
        kernel.gguf_linear(torch.zeros(2, 64, dtype=torch.float64), blocks, qtype, out)


# --- a model read as stored ------------------------------------------------------------------

def _encoder(kinds: dict[str, str], seed: int):
    """write_gguf's ``encode``: each linear whose GGUF name contains a key of ``kinds``
    stored as that type (the float weight quantized, or random blocks for the K-quants)."""
    import gguf

    rng = np.random.default_rng(seed)

    def encode(name: str, weight: np.ndarray):
        for key, type_name in kinds.items():
            if key in name:
                qtype = SUPPORTED.get(type_name) or gguf.GGMLQuantizationType[type_name].value
                if type_name in ("Q4_K", "Q6_K"):
                    raw = random_blocks(qtype, weight.shape[0], weight.shape[1], rng)
                else:
                    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType(qtype))
                return raw, gguf.GGMLQuantizationType(qtype)
        return None

    return encode


# A Llama whose q and k rows llama.cpp's converter permuted (found again at load), in the
# legacy types; a Qwen2 (q/k/v biases) in the K-quants, v in another type than q and k (qkv
# not stacked), its LM head kept float.
MODELS = {
    "llama-q4_0-q4_1-q8_0": ("llama", 128, 256, {"attn_": "Q4_0", "ffn_": "Q4_1",
                                                 "output.weight": "Q8_0"}),
    "qwen2-q4_k-q6_k": ("qwen2", 256, 512, {"attn_q": "Q4_K", "attn_k": "Q4_K",
                                            "attn_v": "Q6_K", "attn_output": "Q6_K",
                                            "ffn_down": "Q6_K", "ffn_": "Q4_K"}),
    # float attention beside Q8_0 MLPs: the float linears stay nn.Linear, and the mixed layers
    # run transformers' forward over both kinds
    "llama-float-attn-q8_0-mlp": ("llama", 128, 256, {"ffn_": "Q8_0"}),
}
# Linears left float per model, and the decoder forward each runs.
FLOAT_LEFT = {"llama-q4_0-q4_1-q8_0": 0, "qwen2-q4_k-q6_k": 1, "llama-float-attn-q8_0-mlp": 9}
FORWARD = {"llama-float-attn-q8_0-mlp": "transformers"}


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-linear-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VCONSOLE_CACHE", str(root))
        yield root


def _write(dir_: Path, name: str, seed: int) -> Path:
    from tests.engine.worker.test_gguf_model import write_gguf

    arch, hidden, ffn, kinds = MODELS[name]
    (dir_ / name).mkdir()
    return write_gguf(dir_ / name / f"{name}.gguf", arch, seed=seed, hidden=hidden, ffn=ffn,
                      heads=2, kv_heads=1, encode=_encoder(kinds, seed))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_on_the_stored_blocks_equal_the_float_paths(tmp_path, gguf_cache, name):
    """The same file served twice: by default (its blocks as stored) and with --dtype float32
    (its float conversion). Every weight is the same float, and the sums differ only by float
    rounding (~1e-7 relative), so greedy tokens are equal."""
    from tests.engine.worker.test_gguf_model import MAX_TOKENS, TEXTS
    from vconsole.engine.core import EngineCore
    from vconsole.engine.offline import greedy_requests, run_batch
    from vconsole.shared.config import EngineConfig

    gguf_linear.use_kernel(None)
    path = _write(tmp_path, name, seed=1)
    stored = EngineCore(EngineConfig(model=str(path), device="cpu"))
    weights = stored.runner.weights
    assert weights is not None and weights.startswith("gguf · ")
    floats_left = [n for n, m in stored.runner.model.named_modules()
                   if isinstance(m, torch.nn.Linear)]
    assert len(floats_left) == FLOAT_LEFT[name]       # the qwen2 file's head, the attentions
    assert stored.runner.forward_path == FORWARD.get(name, "fused")
    # the bandwidth figures count the blocks' bytes a weight (Q4_0 0.5625 ... Q8_0 1.0625),
    # and a kept float linear's at 4 (the mixed file: about half its weights)
    high = 4.0 if name == "llama-float-attn-q8_0-mlp" else 1.1
    assert 0.5 < stored.model_dims()["weight_bytes"] < high
    ids = [list(stored.tokenizer(t, add_special_tokens=False).input_ids) for t in TEXTS]
    got = run_batch(stored, greedy_requests(stored, ids, MAX_TOKENS, ignore_eos=True))
    floats = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert floats.runner.weights is None and floats.model_dims()["weight_bytes"] == 4
    want = run_batch(floats, greedy_requests(floats, ids, MAX_TOKENS, ignore_eos=True))
    # the prompts are prefilled in one step of many rows (the GEMM), decoded in steps of
    # three (the GEMV)
    assert got.output_token_ids == want.output_token_ids


@pytest.mark.slow
def test_a_gguf_of_a_type_not_read_is_refused_with_the_supported_ones(tmp_path, gguf_cache,
                                                                    caplog):
    """Asked for, gguf refuses the file naming the supported types; by default the file runs
    its float conversion, with a warning (as before gguf was the default)."""
    import logging

    from tests.engine.worker.test_gguf_model import write_gguf
    from vconsole.engine.core import EngineCore
    from vconsole.engine.worker import weight_format
    from vconsole.shared.config import EngineConfig

    path = write_gguf(tmp_path / "q5.gguf", "llama", seed=1,
                      encode=_encoder({"ffn_": "Q5_0"}, 1))
    with pytest.raises(ValueError, match=r"reads the quant types Q4_0, Q4_1, Q8_0, Q4_K, Q6_K "
                                         r"\(and float tensors\); this file has Q5_0 "
                                         r"\(blk\.0\.ffn_down\.weight and others\); "
                                         r"--dtype float32"):
        EngineCore(EngineConfig(model=str(path), device="cpu", quantization="gguf"))
    with caplog.at_level(logging.WARNING, logger=weight_format.__name__):
        core = EngineCore(EngineConfig(model=str(path), device="cpu"))
    assert core.runner.weights is None
    assert "type Q5_0, which the gguf kernels do not read" in caplog.text
    # an embedding of a type not read does not matter where the file has its own LM head
    path = write_gguf(tmp_path / "emb.gguf", "llama", seed=1,
                      encode=_encoder({"token_embd": "Q5_0", "blk.": "Q8_0",
                                       "output.weight": "Q8_0"}, 1))
    assert weight_format.chosen(EngineConfig(model=str(path)), "cpu") == "gguf"
