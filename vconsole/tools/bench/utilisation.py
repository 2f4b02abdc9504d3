"""Model-FLOP and memory-bandwidth utilisation of a served GGUF, against this machine's peaks.

`bench throughput --peer llama-server` serves one GGUF from two servers; each row's tokens per
second become two utilisations, both against peaks measured here, in the same run, with the
bench's threads (`vconsole.tools.bench.flops` for the FLOP side):

- **MFU**: useful FLOPs per output token (`ModelShape`: every decoder linear, the LM head, and
  attention at the row's mean position) times the tokens per second, over the float32 matmul
  peak (`flops.matmul_peak_flops`). The weights are 4-bit, so an integer dot-product peak
  would be higher: this says how far from the machine's float ceiling, not from ggml's.
- **MBU**: the bytes a decode step must read (every tensor of every block and the LM head:
  SmolLM2's Q4_1 blocks and its Q8_0 tied embedding, 96.6 MB) times the steps per second, over
  the best read bandwidth of a buffer far larger than the caches (`read_peak_bytes`). One
  stream runs a step per token, so its steps per second are its decode tokens per second; C
  concurrent streams share steps, and ``tok/s / C`` (every step carrying all C) is the fewest
  steps they could have taken: their MBU is a lower bound (``mbu_at_least``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vconsole.tools.bench.flops import ModelShape, matmul_peak_flops

READ_BYTES = 512 << 20          # far beyond any cache on the machines this runs on


@dataclass(frozen=True)
class GGUFWeights:
    shape: ModelShape
    step_bytes: int             # what one decode step reads: the blocks and the LM head


def gguf_weights(path: Path) -> GGUFWeights:
    """The model's shape from a Llama-family GGUF's metadata, and the bytes of its tensors that
    one decode step reads (the token embedding counts when it is the LM head: tied)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def num(key: str) -> int:
        f = r.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    tensors = {t.name: t for t in r.tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    heads = num("attention.head_count")
    hidden = num("embedding_length")
    shape = ModelShape(num_layers=num("block_count"), hidden=hidden, num_heads=heads,
                       num_kv_heads=num("attention.head_count_kv"), head_dim=hidden // heads,
                       intermediate=num("feed_forward_length"),
                       vocab=int(head.shape.tolist()[-1]))
    step = sum(int(t.n_bytes) for n, t in tensors.items() if n.startswith("blk."))
    return GGUFWeights(shape, step + int(head.n_bytes))


def read_peak_bytes(nbytes: int = READ_BYTES, repeats: int = 5) -> float:
    """The best bytes per second of ``repeats`` reads (a sum) of an ``nbytes`` float32 buffer
    with torch's current threads, after one untimed read."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def row_utilisation(fig: dict[str, Any], streams: int, weights: GGUFWeights, position: int,
                    peak_flops: float, peak_bytes: float) -> dict[str, float | None]:
    """One server's row: MFU and MBU (see the module docstring); ``streams``: 1 for the single
    stream (its decode rate), else the concurrency; ``position``: the rows' mean position."""
    s = weights.shape
    per_token = s.token_flops() + s.sample_flops() + s.attention_flops(position, 1)
    if streams == 1:
        rate = fig.get("decode_tokens_per_s") or fig.get("tok_per_s")
        steps = rate
    else:
        rate = fig.get("tok_per_s")
        steps = rate / streams if rate else None
    mfu = rate * per_token / peak_flops if rate else None
    mbu = steps * weights.step_bytes / peak_bytes if steps else None
    key = "mbu" if streams == 1 else "mbu_at_least"
    return {"mfu": None if mfu is None else round(mfu, 5),
            key: None if mbu is None else round(mbu, 4)}


def add_utilisation(result: dict[str, Any], gguf: Path, threads: int, position: int) -> None:
    """Every level's rows in ``result`` (`throughput_http`'s) get their utilisations, and
    ``result["peaks"]`` the two peaks, measured now with ``threads`` torch threads."""
    weights = gguf_weights(gguf)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak_flops = matmul_peak_flops()
        peak_bytes = read_peak_bytes()
    finally:
        torch.set_num_threads(before)
    result["peaks"] = {"matmul_gflops": round(peak_flops / 1e9, 1),
                       "read_gb_s": round(peak_bytes / 1e9, 2), "threads": threads,
                       "step_bytes": weights.step_bytes}
    for level, row in result["levels"].items():
        streams = 1 if level == "single" else int(level)
        for name in ("vconsole", "llama_server"):
            if isinstance(row.get(name), dict):
                row[name]["utilisation"] = row_utilisation(row[name], streams, weights,
                                                            position, peak_flops, peak_bytes)
