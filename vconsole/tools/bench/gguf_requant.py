"""What a GGUF quant type costs in perplexity on the gguf path (issue #47), measured here, with
llama.cpp's own perplexity on the same files beside it.

There is no unquantized SmolLM2 on this machine (models never come from a hub): its GGUF is
Q4_1. The float reference is therefore that file's float conversion (the Q4_1 weights
dequantized, ``--dtype float32``), and each quant type is measured by re-quantizing those float
weights into it (`requantize`: the same metadata and vocabulary, every quantized 2-D tensor
dequantized and quantized again with the ``gguf`` package, the quantizer llama.cpp's reference
implements) and serving the new file on its blocks as stored (``--quantization gguf``).
`compare` scores the same windows of the quality bench's text on each engine, in the same
chunks, and gives each one's perplexity against the float reference. Two more rows: the Q4_1
file itself (the float reference to rounding: the same weights), and ``--quantization int4``
on the float conversion (its linears quantized at load, the LM head at Q8_0). int4 lands back
on the file's own grids (Q4_1 linears, Q8_0 head), so its row is the reference by
construction; the re-quantized Q4_1 file also rounds the tied embedding / LM head (Q8_0 in
the file) to 4 bits, which is most of its loss; Q4_0 and Q8_0 round onto grids of their own.
The file's own loss against SmolLM2's float weights cannot be measured without them.

**llama.cpp's column** (``--llama-cpp``, where ``llama-perplexity`` is built: ``python -m
vconsole.tools.bench.llama_server_build --perplexity``): the same files scored by llama.cpp's
``llama-perplexity`` against its own float reference, an F32 GGUF that `requantize` writes of
the same dequantized weights, so both engines' "type against float" sit side by side. Same
text (the windows' tokens decoded to a file, which llama.cpp tokenizes again), the same
context (``-c`` the window) and number of windows (``--chunks``), the same threads; llama.cpp
scores only the second half of each window (its first token replaced by BOS where the model
adds one), so its absolute perplexity differs from ours, and the columns compare as relative
changes.

``python -m vconsole.tools.bench.gguf_requant [--types Q8_0 Q4_0 Q4_1] [--windows N]
[--llama-cpp]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REQUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")   # the types the gguf package quantizes
FLOAT_TYPE = "F32"                          # llama.cpp's float reference file
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def requantize(src: Path, dst: Path, type_name: str) -> Path:
    """``src`` written to ``dst`` with every quantized 2-D tensor re-quantized to
    ``type_name`` (`REQUANT_TYPES`), or dequantized to float32 (``F32``); float tensors copied
    as they are."""
    import gguf
    import numpy as np

    to_float = type_name == FLOAT_TYPE
    qtype = None if to_float else gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue        # the source's (Q4_1); llama.cpp would name the new file by it
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if qtype is None:
            writer.add_tensor(t.name, rows)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(rows, qtype), raw_dtype=qtype)
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


def llama_cpp_ppl(binary: Path, model: Path, text_file: Path, window_tokens: int,
                  windows: int, threads: int) -> dict[str, float]:
    """``llama-perplexity``'s final estimate on ``model`` (its ``+/-``: llama.cpp's own
    standard error). Where ggml's repacked weight buffers die with SIGILL (a VM that names AMX
    but does not grant its tile state: Q4_1's only repacked layout is AMX's), it runs again
    with ``--no-repack``, as the llama-server peer does, and says so (``no_repack``)."""
    cmd = [str(binary), "-m", str(model), "-f", str(text_file), "-c", str(window_tokens),
           "-b", str(window_tokens), "--chunks", str(windows), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    no_repack = out.returncode == -4
    if no_repack:
        cmd.append("--no-repack")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    text = out.stdout + out.stderr
    found = _FINAL.search(text)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode} without a final "
                           f"estimate: {text[-1500:]}")
    return {"ppl": float(found.group(1)), "ppl_se": float(found.group(2)),
            "no_repack": no_repack}


def compare(types: tuple[str, ...] = REQUANT_TYPES, windows: int = 16, window_tokens: int = 512,
            chunk: int = 512, work: Path | None = None, text: str = "pydoc",
            llama_cpp: Path | None = None, threads: int | None = None,
            int4: bool = True) -> dict[str, Any]:
    """Each type's perplexity against the float reference (module docstring), the Q4_1 file on
    the gguf path and int4 on the float conversion against it; with ``llama_cpp`` (a
    ``llama-perplexity`` binary) llama.cpp's on each file against its F32 file."""
    import torch
    from transformers import AutoTokenizer

    from vconsole.engine.worker.gguf_model import ensure_converted, smollm2_gguf
    from vconsole.tools.bench.quality import token_windows

    src = smollm2_gguf()
    converted = ensure_converted(src)
    tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    # one window more of text than scored: llama.cpp tokenizes the decoded text again
    spare = token_windows(tokenizer, windows + 1, window_tokens, text)
    texts = spare[:windows]
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / "vconsole-gguf-requant"
    work.mkdir(parents=True, exist_ok=True)
    threads = threads or torch.get_num_threads()
    started = time.time()
    load = [os.getloadavg()[0]]
    base, _ = _ppl("smollm2", texts, chunk, dtype="float32")
    rows: dict[str, Any] = {}
    files: dict[str, Path] = {}
    stored, weights = _ppl("smollm2", texts, chunk, quantization="gguf")
    rows["Q4_1 (the file, as stored)"] = {"ppl": stored, "rel_diff": stored / base - 1,
                                         "weights": weights}
    files["Q4_1 (the file, as stored)"] = src
    for type_name in types:
        path = requantize(src, work / f"smollm2-{type_name}.gguf", type_name)
        load.append(os.getloadavg()[0])
        ppl, weights = _ppl(str(path), texts, chunk, quantization="gguf")
        key = f"{type_name} (re-quantized)"
        rows[key] = {"ppl": ppl, "rel_diff": ppl / base - 1, "weights": weights}
        files[key] = path
    if int4:
        ppl, weights = _ppl(str(converted), texts, chunk, quantization="int4")
        rows["int4 (the float conversion quantized at load)"] = {
            "ppl": ppl, "rel_diff": ppl / base - 1, "weights": weights}
    load.append(os.getloadavg()[0])
    out: dict[str, Any] = {
        "benchmark": "gguf_requant", "reference": "smollm2 float32 conversion",
        "reference_ppl": base, "windows": windows, "window_tokens": window_tokens,
        "chunk_tokens": chunk, "text": text, "threads": threads, "rows": rows}
    if llama_cpp is not None:
        text_file = work / f"{text}-{windows + 1}x{window_tokens}.txt"
        text_file.write_text(tokenizer.decode([t for w in spare for t in w]), encoding="utf-8")
        reference = requantize(src, work / f"smollm2-{FLOAT_TYPE}.gguf", FLOAT_TYPE)
        ref = llama_cpp_ppl(llama_cpp, reference, text_file, window_tokens, windows, threads)
        load.append(os.getloadavg()[0])
        out["llama_cpp"] = {
            "binary": str(llama_cpp), "reference": f"{reference.name} (the same dequantized "
            "weights, F32)", "reference_ppl": ref["ppl"], "reference_ppl_se": ref["ppl_se"],
            "scored": "the second half of each window (llama-perplexity's way)",
            "text_file": str(text_file)}
        for key, path in files.items():
            try:
                got = llama_cpp_ppl(llama_cpp, path, text_file, window_tokens, windows, threads)
            except (RuntimeError, subprocess.TimeoutExpired) as e:   # the row says, the rest stays
                rows[key]["llama_cpp"] = {"error": str(e)[-600:]}
                continue
            load.append(os.getloadavg()[0])
            rows[key]["llama_cpp"] = {**got, "rel_diff": got["ppl"] / ref["ppl"] - 1}
    out["elapsed_s"] = round(time.time() - started, 1)
    out["load_average_1min"] = {"min": round(min(load), 2), "max": round(max(load), 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.bench.gguf_requant")
    p.add_argument("--types", nargs="+", default=list(REQUANT_TYPES), choices=REQUANT_TYPES)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window-tokens", type=int, default=512)
    p.add_argument("--text", default="pydoc")
    p.add_argument("--threads", type=int, default=None,
                   help="llama-perplexity's threads (default: torch's)")
    p.add_argument("--no-int4", action="store_true", help="leave out the int4 row")
    p.add_argument("--llama-cpp", action="store_true",
                   help="add llama.cpp's llama-perplexity on the same files (built with python "
                   "-m vconsole.tools.bench.llama_server_build --perplexity)")
    args = p.parse_args(argv)
    binary = None
    if args.llama_cpp:
        from vconsole.tools.bench.llama_server_build import find_llama_perplexity

        binary = find_llama_perplexity()
        if binary is None:
            print("gguf_requant: llama-perplexity is not built here; build it with python -m "
                  "vconsole.tools.bench.llama_server_build --perplexity", file=sys.stderr)
            return 2
    out = compare(tuple(args.types), args.windows, args.window_tokens, text=args.text,
                  llama_cpp=binary, threads=args.threads, int4=not args.no_int4)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
