"""`bench structured`'s compile microbenchmark: each schema through the engine's own
`GrammarCompiler` in this process, cold and cached, after the engine stopped."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from vconsole.tools.bench.structured_schemas import SCHEMAS, heavy_schema


def compile_figures(model_path: str, reps: int = 3) -> dict[str, Any]:
    """Each schema through the engine's own `GrammarCompiler`, in this process: **cold** (a
    fresh compiler, the tokenizer already built: the compile a new spec costs, median of
    ``reps``) and **cached** (the same spec again: the cache's future plus the copy of its
    matcher a request gets, median of 5), in ms."""
    from transformers import AutoTokenizer

    from vconsole.engine.structured.compiler import GrammarCompiler, build_tokenizer
    from vconsole.wire.sampling import StructuredSpec

    hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    gen = Path(model_path) / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos_ids = tuple(eos if isinstance(eos, list) else [eos if eos is not None
                                                       else hf.eos_token_id])
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(hf, vocab, eos_ids)
    tokenizer_s = time.perf_counter() - t0
    out: dict[str, Any] = {}
    named = [(c.name, c.schema_text) for c in SCHEMAS] + [("probe", heavy_schema(0))]
    for name, text in named:
        spec = StructuredSpec("json", text)
        cold, wall, cached = [], [], []
        for rep in range(reps):
            compiler = GrammarCompiler(lambda: tokenizer)
            try:
                _ = compiler.vocab_size             # the tokenizer is ready: compiles only
                t0 = time.perf_counter()
                grammar = compiler.submit(spec)[0].result()
                wall.append(time.perf_counter() - t0)
                if grammar.error or grammar.matcher is None:
                    raise ValueError(f"{name}: {grammar.error}")
                cold.append(grammar.compile_s)
                for _ in range(5 if rep == 0 else 0):
                    t0 = time.perf_counter()
                    fut, hit = compiler.submit(spec)
                    matcher = fut.result().matcher
                    assert hit and matcher is not None
                    matcher.deep_copy()
                    cached.append(time.perf_counter() - t0)
            finally:
                compiler.close()
        out[name] = {"cold_ms": round(statistics.median(cold) * 1e3, 3),
                          "cold_submit_to_ready_ms": round(statistics.median(wall) * 1e3, 3),
                          "cached_ms": round(statistics.median(cached) * 1e3, 4)}
    return {"tokenizer_ms": round(tokenizer_s * 1e3, 1), "schemas": out}
