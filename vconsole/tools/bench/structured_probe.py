"""`bench structured`'s stall probe: cold grammar compiles sent one at a time beside a busy
decode loop (`compile_probe`), and the background's steps while each compiled set against the
steps no probe touched (`stall_figures`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from vconsole.tools.bench.structured_runs import Job
from vconsole.tools.bench.structured_steps import in_window

PROBE_PROMPT = "Fill in the form as one JSON object."
PROBE_TOKENS = 2          # the probe's first mask runs in its prefill step, its second after
BACKGROUND_TOKENS = 800   # outlasts the probes (the background is aborted when they are done)
GAP_STEPS = 6             # background steps between two probes (the "other" steps)


def compile_probe(endpoints: dict[str, str], renderer: Any, background: list[Job],
                  schemas: dict[str, list[str]], max_model_len: int
                  ) -> tuple[dict[str, list[tuple[float, float]]], float, float]:
    """While ``background`` decodes (unconstrained, ``ignore_eos``), send one request per
    schema of ``schemas`` (by group), one at a time, `GAP_STEPS` background steps apart, and
    wait for each to finish. Returns each group's (submit, finish) wall-clock times and the
    window in which the background was decoding."""
    from vconsole.engine.client.client import EngineClient
    from vconsole.tools.prompts import ChatPrompt

    probe_ids = renderer.ids(ChatPrompt(None, PROBE_PROMPT))
    marks: dict[str, list[tuple[float, float]]] = {g: [] for g in schemas}
    with EngineClient(endpoints["input"], endpoints["output"], timeout_s=60) as client:
        bg = [client.submit(prompt_token_ids=j.prompt_ids, ignore_eos=True, temperature=0.0,
                            max_tokens=min(BACKGROUND_TOKENS,
                                           max_model_len - len(j.prompt_ids) - 1))
              for j in background]
        first = set()
        for out in client.outputs(600):          # every background row past its prefill
            if out.new_token_ids:
                first.add(out.request_id)
            if len(first) == len(bg):
                break

        def steps(n: int) -> None:               # n outputs of one background row
            for i, _out in enumerate(client.stream(bg[0], 600)):
                if i + 1 >= n:
                    return

        t_bg = time.time()
        for group, texts in schemas.items():
            for text in texts:
                steps(GAP_STEPS)
                sent = time.time()
                rid = client.submit(prompt_token_ids=probe_ids, max_tokens=PROBE_TOKENS,
                                    temperature=0.0, structured={"kind": "json", "value": text})
                for out in client.stream(rid, 600):
                    if out.finished:
                        if out.error:
                            raise RuntimeError(f"compile probe failed: {out.error}")
                        break
                marks[group].append((sent, time.time()))
        steps(GAP_STEPS)
        t_end = time.time()
        client.abort(bg)
        client.gather(bg, 60)
    return marks, t_bg, t_end


def _classify(window: list[dict[str, Any]], started: float, marks: list[tuple[float, float]]
              ) -> tuple[list[float], list[float], set[float]]:
    """The decode-only steps that ran while each probe's grammar compiled (from its submit to
    the step that admitted it: ``new_reqs`` > 0), those after it (its first masks, to its
    finish), and the start times of every step a probe touched (prefills included)."""
    compiling: list[float] = []
    first_masks: list[float] = []
    used: set[float] = set()
    for sent, done in marks:
        lo, hi = sent - started, done - started
        admitted = next((s for s in window if s["t"] + s["dur"] >= lo and s["new_reqs"] > 0),
                        None)
        cut = admitted["t"] if admitted else hi
        for s in window:
            if s is admitted or (s["prefill"] and lo <= s["t"] <= hi):
                used.add(s["t"])
            elif s["t"] + s["dur"] >= lo and s["t"] < cut:   # ran while the grammar compiled
                compiling.append(s["dur"])
                used.add(s["t"])
            elif cut < s["t"] <= hi:
                first_masks.append(s["dur"])
                used.add(s["t"])
    return compiling, first_masks, used


def _ms(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3) if xs else None


def stall_figures(steps: list[dict[str, Any]], started: float,
                  marks: dict[str, list[tuple[float, float]]], t_bg: float,
                  t_end: float) -> dict[str, Any]:
    """Per probe group: its compile-window and first-mask steps (`_classify`) against the
    window's other decode-only steps at the background's batch (no probe in them)."""
    window = in_window(steps, started, t_bg, t_end)
    groups = {g: _classify(window, started, m) for g, m in marks.items()}
    used = set().union(*(u for _c, _f, u in groups.values())) if groups else set()
    rows = statistics.median(s["decode"] for s in window) if window else 0
    other = [s["dur"] for s in window if s["t"] not in used and s["prefill"] == 0
             and s["decode"] >= rows - 1]
    med, p90, mx = _ms(other, 0.5), _ms(other, 0.9), _ms(other, 1.0)
    out: dict[str, Any] = {
        "background_rows": rows, "other_steps": len(other),
        "other_ms": {"median": med, "p90": p90, "max": mx}}
    for g, (compiling, first_masks, _u) in groups.items():
        cmed = _ms(compiling, 0.5)
        out[g] = {
            "probes": len(marks[g]), "steps_while_compiling": len(compiling),
            "while_compiling_ms": {"median": cmed, "max": _ms(compiling, 1.0)},
            "steps_first_masks": len(first_masks),
            "first_masks_ms": {"median": _ms(first_masks, 0.5), "max": _ms(first_masks, 1.0)},
            "while_compiling_over_other_median": round(cmed / med, 3) if cmed and med
            else None,
            "while_compiling_over_other_p90": sum(1 for d in compiling if p90 is not None
                                                  and d * 1e3 > p90),
            "while_compiling_over_other_max": sum(1 for d in compiling if mx is not None
                                                  and d * 1e3 > mx)}
    return out

