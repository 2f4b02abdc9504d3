"""What a GGUF quant type costs in perplexity on the gguf path (issue #47), measured here.

There is no unquantized SmolLM2 on this machine (models never come from a hub): its GGUF is
Q4_1. The float reference is therefore that file's float conversion (the Q4_1 weights
dequantized, ``--dtype float32``), and each quant type is measured by re-quantizing those float
weights into it (`requantize`: the same metadata and vocabulary, every quantized linear
dequantized and quantized again with the ``gguf`` package) and serving the new file on its
blocks as stored (``--quantization gguf``). `compare` scores the same windows of the quality
bench's text on each engine, in the same chunks, and gives each one's perplexity against the
float reference. The Q4_1 file itself on the gguf path is the float reference to rounding
(the same weights); its own loss against SmolLM2's float weights is the file's, and cannot be
measured without them.

``python -m vconsole.tools.bench.gguf_requant [--types Q8_0 Q4_0 Q4_1] [--windows N]`` prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REQUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")   # the types the gguf package quantizes


def requantize(src: Path, dst: Path, type_name: str) -> Path:
    """``src`` written to ``dst`` with every quantized 2-D tensor re-quantized to
    ``type_name`` (float tensors copied as they are)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(rows.astype(np.float32), qtype),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _ppl(model: str, texts: list[list[int]], chunk: int, **config: Any) -> tuple[float, str]:
    from vconsole.engine.core import EngineCore
    from vconsole.shared.config import EngineConfig
    from vconsole.tools.bench.quality import engine_window_logprobs, perplexity

    core = EngineCore(EngineConfig(model=model, device="cpu", max_num_batched_tokens=chunk,
                                   **config))
    lps = engine_window_logprobs(core, texts)
    weights = core.runner.weights or "float32"
    del core
    count = sum(len(w) for w in lps)
    return perplexity(-math.fsum(x for w in lps for x in w), count), weights


def compare(types: tuple[str, ...] = REQUANT_TYPES, windows: int = 16, window_tokens: int = 512,
            chunk: int = 512, work: Path | None = None, text: str = "pydoc") -> dict[str, Any]:
    """Each type's perplexity against the float reference (module docstring), and the Q4_1
    file on the gguf path against it."""
    from transformers import AutoTokenizer

    from vconsole.engine.worker.gguf_model import ensure_converted, smollm2_gguf
    from vconsole.tools.bench.quality import token_windows

    src = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(src), local_files_only=True)
    texts = token_windows(tokenizer, windows, window_tokens, text)
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / "vconsole-gguf-requant"
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    base, _ = _ppl("smollm2", texts, chunk, dtype="float32")
    rows: dict[str, Any] = {}
    stored, weights = _ppl("smollm2", texts, chunk, quantization="gguf")
    rows["Q4_1 (the file, as stored)"] = {"ppl": stored, "rel_diff": stored / base - 1,
                                         "weights": weights}
    for type_name in types:
        path = requantize(src, work / f"smollm2-{type_name}.gguf", type_name)
        ppl, weights = _ppl(str(path), texts, chunk, quantization="gguf")
        rows[f"{type_name} (re-quantized)"] = {"ppl": ppl, "rel_diff": ppl / base - 1,
                                               "weights": weights}
    return {"benchmark": "gguf_requant", "reference": "smollm2 float32 conversion",
            "reference_ppl": base, "windows": windows, "window_tokens": window_tokens,
            "chunk_tokens": chunk, "text": text, "rows": rows,
            "elapsed_s": round(time.time() - started, 1),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.bench.gguf_requant")
    p.add_argument("--types", nargs="+", default=list(REQUANT_TYPES), choices=REQUANT_TYPES)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window-tokens", type=int, default=512)
    p.add_argument("--text", default="pydoc")
    args = p.parse_args(argv)
    out = compare(tuple(args.types), args.windows, args.window_tokens, text=args.text)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
