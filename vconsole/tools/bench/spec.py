"""`vconsole bench spec`: n-gram speculative decoding against none, one stream, as JSON.

**Workloads** (greedy, chat template of the model, ``--max-tokens`` each, EOS honoured):

* ``quoting``: an instruction over a given passage that makes the answer quote it — correct
  its typos, rewrite it with one word replaced, extract fields as JSON, repeat its key
  sentences, summarise it — over the three passages of `vconsole.tools.prompts` (the typo
  version made by swapping letters in every eighth word);
* ``chat``: free questions of `vconsole.tools.prompts.ALL_QUESTIONS` (nothing to quote: the
  lookup rarely finds a draft, and what it finds is mostly rejected).

**The two sides.** Two engine cores in this process on the same model, one with
``--speculative-config`` (``--spec``, default k=4, lookup 2..4), one without; requests run one
at a time (a single stream), each prompt on both sides in turn, the order alternating from
prompt to prompt so that the machine's drift falls on both. Per side and workload: output
tokens, seconds, tok/s (output tokens over the requests' summed wall time, prefill included:
what one user waits for), the decode tok/s (after the first token), and the decode steps'
count and median time (a draft step costs more than a plain one; on a loaded machine the median
is steadier than the sums). ``speedup``: the spec
side's tok/s over the plain side's. ``identical``: every request's greedy token ids equal on
both sides (the greedy guarantee; a float tie broken differently by the draft row's wider
matmul would show here). The spec side's counters (vLLM's: drafts, drafted and accepted
tokens, accepted per position) per workload, with the acceptance rate and tokens per step.

Goals (issue #47): ``quoting`` speedup >= 1.5, ``chat`` >= 0.95. The machine's load average
at the start and the end is in the JSON: report the figures with it.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.engine.request import Request
from vconsole.shared.config import EngineConfig
from vconsole.tools.prompts import ALL_QUESTIONS, PASSAGES, ChatPrompt, ChatRenderer
from vconsole.wire.sampling import SamplingParams

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}


def _typos(text: str, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split(" ")
    for i in range(3, len(words), 8):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def quoting_prompts() -> list[ChatPrompt]:
    out = []
    for i, passage in enumerate(PASSAGES):
        out += [
            ChatPrompt(None, "Correct the spelling mistakes in the following text. Reply with "
                             f"the corrected text only.\n\n{_typos(passage, i)}"),
            ChatPrompt(None, "Rewrite the following text exactly, but replace the word 'the' "
                             f"with 'this' everywhere.\n\n{passage}"),
            ChatPrompt(None, "Extract from the text below, as JSON, the fields \"subject\", "
                             "\"key_dates\" (a list) and \"key_sentences\" (the three most "
                             f"important sentences, quoted exactly).\n\n{passage}"),
            ChatPrompt(None, "Summarize the following passage, quoting its most important "
                             f"sentences.\n\n{passage}"),
        ]
    return out


def chat_prompts(n: int) -> list[ChatPrompt]:
    return [ChatPrompt(None, q) for q in ALL_QUESTIONS[:n]]


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _one(core: EngineCore, rid: str, ids: list[int], max_tokens: int,
         step_ms: list[float] | None = None) -> tuple[list[int], float, float]:
    """Run one request alone: (output ids, seconds, seconds to the first token); the decode
    steps' times (ms) go to ``step_ms``."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req: Request = core.make_request(rid, prompt_token_ids=ids, sampling=sp)
    t0 = time.perf_counter()
    if core.add_request(req) is not None:
        raise ValueError(f"request {rid} refused: {req.error}")
    first = None
    while core.has_unfinished_requests():
        decoding = bool(req.output_token_ids)   # a step before the first token is prefill
        core.step()
        if first is None and req.output_token_ids:
            first = time.perf_counter() - t0
        elif decoding and step_ms is not None and core.last_step is not None:
            step_ms.append(core.last_step.total_ns / 1e6)
    return list(req.output_token_ids), time.perf_counter() - t0, first or 0.0


def _counters(core: EngineCore) -> dict[str, Any]:
    s = core.scheduler
    return {"num_drafts": s.spec_num_drafts, "num_draft_tokens": s.spec_num_draft_tokens,
            "num_accepted_tokens": s.spec_num_accepted_tokens,
            "accepted_per_pos": list(s.spec_accepted_per_pos)}


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {k: b[k] - a[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    out["accepted_per_pos"] = [y - x for x, y in zip(a["accepted_per_pos"],
                                                     b["accepted_per_pos"], strict=True)]
    out["acceptance_rate"] = (round(out["num_accepted_tokens"] / out["num_draft_tokens"], 4)
                              if out["num_draft_tokens"] else None)
    out["tokens_per_draft_step"] = (round(1 + out["num_accepted_tokens"] / out["num_drafts"], 3)
                                    if out["num_drafts"] else None)
    return out


def _side(tokens: float, seconds: float, decode_tokens: float, decode_s: float
          ) -> dict[str, Any]:
    return {"output_tokens": int(tokens), "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 2) if seconds else None,
            "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s else None}


def spec_bench(model: str, *, spec: dict[str, Any] | None = None, max_tokens: int = 128,
               num_chat: int = 8, quantization: str | None = None,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    spec = dict(DEFAULT_SPEC if spec is None else spec)
    say = log or (lambda _m: None)
    base = EngineConfig(model=model, device="cpu", enable_prefix_caching=False,
                        quantization=quantization)
    load0 = _load()
    say(f"loading {model} twice (with and without speculation)")
    cores = {"plain": EngineCore(base),
             "spec": EngineCore(base.replace(speculative_config=json.dumps(spec)))}
    renderer = ChatRenderer(cores["plain"].tokenizer)
    workloads = {"quoting": quoting_prompts(), "chat": chat_prompts(num_chat)}
    # warm both (first forwards build caches and kernels)
    warm = renderer.ids(ChatPrompt(None, "Say hello."))
    for core in cores.values():
        _one(core, "warm", warm, 8)
    report: dict[str, Any] = {"bench": "spec", "model": model, "quantization": quantization,
                              "weights": cores["plain"].runner.weights or "float",
                              "speculative_config": spec, "max_tokens": max_tokens,
                              "single_stream": True, "load_avg_start": load0,
                              "threads": _threads(), "workloads": {}}
    n = 0
    for name, prompts in workloads.items():
        sums: dict[str, list[float]] = {side: [0, 0.0, 0, 0.0] for side in cores}
        steps: dict[str, list[float]] = {side: [] for side in cores}
        before = _counters(cores["spec"])
        identical = True
        diverged: list[int] = []
        for i, prompt in enumerate(prompts):
            ids = renderer.ids(prompt)
            order = ["plain", "spec"] if n % 2 == 0 else ["spec", "plain"]
            got: dict[str, list[int]] = {}
            for side in order:
                out, secs, first = _one(cores[side], f"{name}{i}-{side}", ids, max_tokens,
                                        steps[side])
                got[side] = out
                acc = sums[side]
                acc[0] += len(out)
                acc[1] += secs
                acc[2] += max(0, len(out) - 1)
                acc[3] += secs - first
            n += 1
            if got["plain"] != got["spec"]:
                identical = False
                diverged.append(i)
            say(f"{name} {i + 1}/{len(prompts)}: {len(got['plain'])} tokens, "
                f"{'same' if got['plain'] == got['spec'] else 'DIFFERENT'}")
        sides = {side: {**_side(*sums[side]), "decode_steps": len(steps[side]),
                        "median_decode_step_ms": round(statistics.median(steps[side]), 2)
                        if steps[side] else None} for side in cores}
        plain, fast = sides["plain"]["tok_s"], sides["spec"]["tok_s"]
        report["workloads"][name] = {
            "requests": len(prompts), **sides,
            "speedup": round(fast / plain, 3) if plain and fast else None,
            "decode_speedup": (round(sides["spec"]["decode_tok_s"]
                                     / sides["plain"]["decode_tok_s"], 3)
                               if sides["plain"]["decode_tok_s"] else None),
            "identical": identical, "diverged": diverged,
            "spec_counters": _delta(before, _counters(cores["spec"]))}
    report["load_avg_end"] = _load()
    report["goals"] = {"quoting_speedup_min": 1.5, "chat_speedup_min": 0.95}
    for core in cores.values():
        core.close()
    return report


def _threads() -> int:
    import torch

    return torch.get_num_threads()
