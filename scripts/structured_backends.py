"""Measure the two grammar libraries for constrained decoding — llguidance and xgrammar — on
SmolLM2-135M-Instruct's tokenizer (49,152 tokens), the figures behind docs/structured.md
"Why llguidance".

    .venv/bin/pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi   # once, outside the venv
    PYTHONPATH=/tmp/xg HF_HUB_OFFLINE=1 .venv/bin/python scripts/structured_backends.py [--json] [--out F]

(``--no-deps`` because xgrammar's requirements would pull triton; without xgrammar on the path
the script measures llguidance alone.) The specs are the six JSON schemas of `vconsole bench
structured` (nested objects, arrays, enums, required fields, string patterns; all bounded), a
regex and a choice; each has a valid instance (JSON written compactly, ``{"a":1}``, as the
engine's grammars have no free whitespace), tokenized by the model's own tokenizer and ended
with EOS: the "real accepted token sequence" every figure below walks. llguidance compiles the
engine's own grammar text (`vconsole.engine.structured.grammar.to_grammar`); xgrammar the same
spec with ``any_whitespace=False`` and compact separators, a choice as an EBNF alternation.

Per library and spec:

- **tokenizer**: building the library's view of the vocabulary (once per model).
- **compile cold**: the spec to a matcher ready for its first mask, nothing cached (llguidance:
  ``grammar_from`` + ``LLMatcher``; xgrammar: ``GrammarCompiler.compile_*`` after
  ``clear_cache()`` + ``GrammarMatcher``); the median of ``--reps``.
- **compile cached**: a second request with the same spec (llguidance has no compiled-grammar
  cache of its own: a pristine matcher is kept per spec and ``deep_copy()``-ed, as the engine's
  cache does; xgrammar: its compiler's cache hit + ``GrammarMatcher``).
- **first mask**: the first mask of a fresh matcher (llguidance builds its lexer lazily, so part
  of its compile shows here instead).
- **mask µs/step**: one row's mask filled into a bitmask row at every step of the instance;
  the first walk of a spec (where a library that builds its automata lazily pays for them:
  llguidance's lexer states) apart from ``--reps`` later walks from the cached matcher (warm:
  mean, median, max); each sampled token is checked to be in the mask, then consumed.
- **batch of 32** (all specs mixed, rows at different positions, a finished row replaced by a
  fresh matcher outside the timing): llguidance ``fill_next_token_bitmask_par`` with an
  ``LLExecutor`` and ``consume_token_par``; xgrammar ``BatchGrammarMatcher``'s
  ``batch_fill_next_token_bitmask`` and ``batch_accept_token``; per step and per row, both with
  this machine's cores as threads; beside them the same rows filled one after another with the
  single-row call (``serial``), which says what the library's parallel fill buys here. The
  batch runs ``--rounds`` rounds, the libraries alternating, each figure the rounds' median.

Prints a Markdown table (or the JSON with ``--json``); ``--out`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402  (after the path: the script runs from a checkout)
from transformers import AutoTokenizer  # noqa: E402

from vconsole.engine.structured.grammar import to_grammar  # noqa: E402
from vconsole.engine.worker.model_loader import resolve_model_path  # noqa: E402
from vconsole.tools.bench.structured_schemas import CHOICE_SPEC, REGEX_SPEC, SCHEMAS  # noqa: E402
from vconsole.wire.sampling import StructuredSpec  # noqa: E402

BATCH = 32
BATCH_STEPS = 300


def specs() -> list[tuple[str, str, str, str]]:
    """``(name, kind, value, valid text)`` for every measured spec."""
    out = [(c.name, "json", c.schema_text, json.dumps(c.example, separators=(",", ":")))
           for c in SCHEMAS]
    out.append(("regex", REGEX_SPEC[0], REGEX_SPEC[1], REGEX_SPEC[2]))
    out.append(("choice", CHOICE_SPEC[0], CHOICE_SPEC[1], CHOICE_SPEC[2]))
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tok: Any, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt

        self.lib, self.llt = llguidance, llt
        self.version = llguidance.__version__
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos)
        self.tokenizer_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=os.cpu_count() or 1)
        self.pristine: dict[str, Any] = {}

    def compile_cold(self, kind: str, value: str) -> Any:
        grammar = to_grammar(StructuredSpec(kind, value))   # the engine's own grammar text
        m = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def remember(self, key: str, matcher: Any) -> None:
        self.pristine[key] = matcher.deep_copy()

    def copy(self, matcher: Any) -> Any:
        return matcher.deep_copy()

    def compile_cached(self, key: str) -> Any:
        return self.pristine[key].deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def fill_batch(self, rows: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(rows)],
                                             bitmask)

    def accept_batch(self, rows: list[Any], tokens: list[int]) -> list[bool]:
        return list(self.llt.consume_token_par(self.executor, list(zip(rows, tokens, strict=True))))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tok: Any, vocab: int, eos: int) -> None:
        import importlib.metadata

        import xgrammar as xgr

        self.xgr = xgr
        self.version = importlib.metadata.version("xgrammar")
        threads = os.cpu_count() or 1
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.tokenizer_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def _compile(self, kind: str, value: str) -> Any:
        if kind == "json":      # the engine's JSON: no free whitespace (engine/structured)
            return self.compiler.compile_json_schema(value, any_whitespace=False,
                                                     separators=(",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "choice":    # as vLLM's xgrammar backend does: an EBNF alternation
            alts = " | ".join(json.dumps(c) for c in json.loads(value))
            return self.compiler.compile_grammar(f"root ::= {alts}")
        raise ValueError(kind)

    def compile_cold(self, kind: str, value: str) -> Any:
        self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self._compile(kind, value))

    def remember(self, key: str, matcher: Any) -> None:
        pass

    def copy(self, matcher: Any) -> Any:
        return matcher.fork()

    def compile_cached(self, key: str) -> Any:
        kind, value = key.split("\0", 1)
        return self.xgr.GrammarMatcher(self._compile(kind, value))

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def fill_batch(self, rows: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(rows, bitmask)

    def accept_batch(self, rows: list[Any], tokens: list[int]) -> list[bool]:
        return list(self.batch.batch_accept_token(rows, tokens))


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def measure(lib: Any, spec_list: list[tuple[str, str, str, str]], seqs: dict[str, list[int]],
            vocab: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    words = (vocab + 31) // 32
    per_spec: dict[str, Any] = {}
    for name, kind, value, _text in spec_list:
        key = f"{kind}\0{value}"
        cold, cached, first = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            m = lib.compile_cold(kind, value)
            cold.append(time.perf_counter() - t0)
        lib.remember(key, m)
        for _ in range(reps):
            t0 = time.perf_counter()
            m = lib.compile_cached(key)
            cached.append(time.perf_counter() - t0)
        walks: list[list[float]] = []
        bitmask = torch.full((1, words), -1, dtype=torch.int32)
        for _ in range(reps + 1):
            m = lib.compile_cached(key)
            walks.append([])
            for i, tok in enumerate(seqs[name]):
                t0 = time.perf_counter()
                lib.fill(m, bitmask, 0)
                dt = time.perf_counter() - t0
                walks[-1].append(dt)
                if i == 0:
                    first.append(dt)
                if not _allowed(bitmask, 0, tok):
                    raise AssertionError(f"{lib.name} {name}: token {i} ({tok}) not in the mask")
                if not lib.accept(m, tok):
                    raise AssertionError(f"{lib.name} {name}: token {i} ({tok}) refused")
        steps = [dt for walk in walks[1:] for dt in walk]
        per_spec[name] = {
            "kind": kind, "tokens": len(seqs[name]),
            "compile_cold_ms": _ms(statistics.median(cold)),
            "compile_cached_ms": _ms(statistics.median(cached)),
            "first_mask_us": _us(first[0]),
            "first_walk_mask_us_mean": _us(statistics.fmean(walks[0])),
            "first_walk_mask_us_max": _us(max(walks[0])),
            "mask_us_mean": _us(statistics.fmean(steps)),
            "mask_us_median": _us(statistics.median(steps)),
            "mask_us_max": _us(max(steps)),
        }
        log(f"{lib.name} {name}: {per_spec[name]}")
    return {"version": lib.version, "tokenizer_ms": _ms(lib.tokenizer_s), "specs": per_spec}


def measure_batch(lib: Any, spec_list: list[tuple[str, str, str, str]],
                  seqs: dict[str, list[int]], words: int) -> dict[str, Any]:
    """``BATCH`` rows, spec ``r % len(specs)``, row r starting ``r // len(specs) * 3`` tokens in;
    ``BATCH_STEPS`` steps of one batched fill and one batched accept."""
    names = [s[0] for s in spec_list]
    keys = {s[0]: f"{s[1]}\0{s[2]}" for s in spec_list}
    rows: list[Any] = []
    pos: list[int] = []
    for r in range(BATCH):
        name = names[r % len(names)]
        m = lib.compile_cached(keys[name])
        start = min(r // len(names) * 3, len(seqs[name]) - 1)
        for tok in seqs[name][:start]:
            assert lib.accept(m, tok)
        rows.append(m)
        pos.append(start)
    bitmask = torch.full((BATCH, words), -1, dtype=torch.int32)
    # the serial fills run on copies (a matcher may keep the mask of its current state, and the
    # batched fill must not find it computed)
    twins = [lib.copy(m) for m in rows]
    serial = torch.full((BATCH, words), -1, dtype=torch.int32)
    fills, accepts, serials = [], [], []
    for _ in range(BATCH_STEPS):
        t0 = time.perf_counter()
        for r, m in enumerate(twins):
            lib.fill(m, serial, r)
        serials.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lib.fill_batch(rows, bitmask)
        fills.append(time.perf_counter() - t0)
        toks = [seqs[names[r % len(names)]][pos[r]] for r in range(BATCH)]
        for r, tok in enumerate(toks):
            if not _allowed(bitmask, r, tok):
                raise AssertionError(f"{lib.name} batch row {r}: token {tok} not in the mask")
        t0 = time.perf_counter()
        ok = lib.accept_batch(rows, toks)
        accepts.append(time.perf_counter() - t0)
        if not all(ok) or not all(lib.accept(m, tok) for m, tok in zip(twins, toks, strict=True)):
            raise AssertionError(f"{lib.name} batch: refused tokens {ok}")
        for r in range(BATCH):
            pos[r] += 1
            name = names[r % len(names)]
            if pos[r] == len(seqs[name]):           # ended with EOS: a new request takes the row
                rows[r], pos[r] = lib.compile_cached(keys[name]), 0
                twins[r] = lib.copy(rows[r])
    fill, acc = statistics.fmean(fills), statistics.fmean(accepts)
    return {"fill_us_per_step": _us(fill), "fill_us_per_row": _us(fill / BATCH),
            "fill_us_p99": _us(sorted(fills)[int(0.99 * len(fills))]),
            "serial_fill_us_per_step": _us(statistics.fmean(serials)),
            "accept_us_per_step": _us(acc), "accept_us_per_row": _us(acc / BATCH)}


def batch_rounds(libs: list[Any], spec_list: list[tuple[str, str, str, str]],
                 seqs: dict[str, list[int]], words: int, rounds: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """``rounds`` rounds of `measure_batch`, the libraries alternating within each round (a
    neighbour's job then hits both alike); each figure is the median over the rounds."""
    runs: dict[str, list[dict[str, float]]] = {lib.name: [] for lib in libs}
    for i in range(rounds):
        for lib in libs:
            runs[lib.name].append(measure_batch(lib, spec_list, seqs, words))
            log(f"batch round {i + 1} {lib.name}: {runs[lib.name][-1]}")
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]}
        out[name].update(rows=BATCH, steps=BATCH_STEPS, rounds=rounds, threads=os.cpu_count(),
                         fill_us_per_step_rounds=[r["fill_us_per_step"] for r in rs])
    return out


def table(results: dict[str, Any]) -> str:
    libs = [k for k in ("llguidance", "xgrammar") if k in results["libraries"]]
    lines = ["| spec | tokens | " + " | ".join(
        f"{lib} cold ms | {lib} cached ms | {lib} mask µs 1st walk mean (max) | "
        f"{lib} mask µs warm mean (max)" for lib in libs) + " |",
        "|---|---:|" + "---:|---:|---:|---:|" * len(libs)]
    first = results["libraries"][libs[0]]["specs"]
    for name, row in first.items():
        cells = [name, str(row["tokens"])]
        for lib in libs:
            s = results["libraries"][lib]["specs"][name]
            cells += [f"{s['compile_cold_ms']:.2f}", f"{s['compile_cached_ms']:.3f}",
                      f"{s['first_walk_mask_us_mean']:.0f} ({s['first_walk_mask_us_max']:.0f})",
                      f"{s['mask_us_mean']:.0f} ({s['mask_us_max']:.0f})"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| batch of 32 | " + " | ".join(libs) + " |", "|---|" + "---:|" * len(libs)]
    for label, key in (("fill, µs per step", "fill_us_per_step"),
                       ("fill, µs per row", "fill_us_per_row"),
                       ("fill, p99 µs per step", "fill_us_p99"),
                       ("serial single-row fills, µs per step", "serial_fill_us_per_step"),
                       ("accept, µs per step", "accept_us_per_step")):
        lines.append(f"| {label} | " + " | ".join(
            f"{results['libraries'][lib]['batch'][key]:.0f}" for lib in libs) + " |")
    lines.append("| tokenizer setup, ms | " + " | ".join(
        f"{results['libraries'][lib]['tokenizer_ms']:.0f}" for lib in libs) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the batch of 32")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    hf_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = json.loads((path / "config.json").read_text())
    vocab = int(config["vocab_size"])
    eos = int(hf_tok.eos_token_id)
    spec_list = specs()
    seqs = {name: hf_tok.encode(text, add_special_tokens=False) + [eos]
            for name, _k, _v, text in spec_list}
    backends: list[type] = [Llguidance]
    try:
        import xgrammar  # noqa: F401
        backends.append(Xgrammar)
    except ImportError:
        log("xgrammar not importable (see the header): llguidance only")
    results: dict[str, Any] = {
        "model": args.model, "vocab_size": vocab, "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average": list(os.getloadavg()), "reps": args.reps, "libraries": {}}
    libs = [cls(hf_tok, vocab, eos) for cls in backends]
    for lib in libs:
        results["libraries"][lib.name] = measure(lib, spec_list, seqs, vocab, args.reps, log)
    batch = batch_rounds(libs, spec_list, seqs, (vocab + 31) // 32, args.rounds, log)
    for lib in libs:
        results["libraries"][lib.name]["batch"] = batch[lib.name]
    results["load_average_end"] = list(os.getloadavg())
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
