"""`bench throughput`'s report: the rounds put together — one peak for the whole run and each
contender's utilisation against it, a row per round, the median round's figures, the medians
and worsts of the ratios, and the goals met or not."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

GOAL = {"median_vs_static": 3.0, "median_vs_generate_batch": 8.0, "worst_vs_static": 2.0,
        "steady_utilisation": 0.6}
# Issue #30's weights goals: the int8 single stream against float32's and llama.cpp's Q4_1, and
# 64 concurrent requests against llama.cpp serving them one after another.
WEIGHTS_GOAL = {"single_stream_vs_float32": 2.0, "single_stream_vs_llama_cpp": 0.8,
                "concurrent_vs_llama_cpp_sequential": 5.0}


def _add_utilisation(result: dict[str, Any], peak_gflops: float) -> None:
    """``utilisation`` (useful FLOP/s over the peak) beside each ``gflops`` of a contender's
    result (the engine's decode parts included)."""
    for part in (result, result.get("decode_all"), result.get("decode_steady")):
        if part and "gflops" in part:
            part["utilisation"] = round(part["gflops"] / peak_gflops, 3)


def ratio(ours: float, theirs: float | None) -> float | None:
    """Ours over theirs, to two places; None when theirs is missing (a contender not run or
    failed)."""
    return round(ours / theirs, 2) if theirs else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def summarise(result: dict[str, Any], rounds: list[dict[str, Any]], transformers: bool) -> None:
    """Fill ``result`` (the run's settings) with the figures of ``rounds`` (`_one_round`'s, in
    `vconsole.tools.bench.throughput`); ``transformers``: whether its two contenders ran."""
    # One peak for the whole run, the best any round measured: a round whose peak a neighbour's
    # load pulled down must not flatter its utilisation.
    peak = max(r["peak_gflops"] for r in rounds)
    for r in rounds:
        for key in ("engine", "hf_static", "hf_generate_batch"):
            if key in r:
                _add_utilisation(r[key], peak)
    result["peak_gflops"] = peak
    result["runs"] = [{"engine_tokens_per_s": r["engine"]["tokens_per_s"],
                       "static_tokens_per_s": r.get("hf_static", {}).get("tokens_per_s"),
                       "generate_batch_tokens_per_s": r.get("hf_generate_batch", {})
                       .get("tokens_per_s"),
                       "ratio_static": r["ratio_vs_static"],
                       "ratio_generate_batch": r["ratio_vs_generate_batch"],
                       "decode_step_ms": r["engine"].get("decode_step_ms"),
                       "single_stream_tokens_per_s": r["single_stream"]["decode_tokens_per_s"],
                       "single_stream_float32_tokens_per_s": r.get("single_stream_float32", {})
                       .get("decode_tokens_per_s"),
                       "llama_cpp_single_stream_tokens_per_s": r.get("llama_cpp", {})
                       .get("single_stream", {}).get("decode_tokens_per_s"),
                       "llama_cpp_sequential_tokens_per_s": r.get("llama_cpp", {})
                       .get("sequential", {}).get("tokens_per_s"),
                       "single_stream_vs_float32": r["single_stream_vs_float32"],
                       "single_stream_vs_llama_cpp": r["single_stream_vs_llama_cpp"],
                       "concurrent_vs_llama_cpp_sequential":
                           r["concurrent_vs_llama_cpp_sequential"],
                       "peak_gflops": r["peak_gflops"], "load_average": r["load_average"],
                       "utilisation": r["engine"]["utilisation"],
                       "steady_utilisation": r["engine"].get("decode_steady", {})
                       .get("utilisation")} for r in rounds]
    # The median round (by the static ratio, or the engine's rate without transformers) fills
    # the keys of a single-round report.
    order: Callable[[dict[str, Any]], float] = (
        (lambda r: r["ratio_vs_static"]) if transformers
        else (lambda r: r["engine"]["tokens_per_s"]))
    median_round = sorted(rounds, key=order)[(len(rounds) - 1) // 2]
    result.update({k: v for k, v in median_round.items() if k != "peak_gflops"})
    steady = [u for r in result["runs"] if (u := r["steady_utilisation"]) is not None]
    result["median_utilisation"] = round(statistics.median(r["utilisation"]
                                                           for r in result["runs"]), 3)
    result["median_steady_utilisation"] = round(statistics.median(steady), 3) if steady else None
    result["median_single_stream_tokens_per_s"] = _median(
        [r["single_stream_tokens_per_s"] for r in result["runs"]])
    weights = {k: _median([r[k] for r in result["runs"]]) for k in WEIGHTS_GOAL}
    result.update({f"median_{k}": v for k, v in weights.items()})
    if transformers:
        static = [r["ratio_vs_static"] for r in rounds]
        gb = [r["ratio_vs_generate_batch"] for r in rounds if r["ratio_vs_generate_batch"]]
        result["median_ratio_static"] = round(statistics.median(static), 2)
        result["worst_ratio_static"] = min(static)
        result["median_ratio_generate_batch"] = round(statistics.median(gb), 2) if gb else None
        result["worst_ratio_generate_batch"] = min(gb) if gb else None
        met = {"median_vs_static": result["median_ratio_static"] >= GOAL["median_vs_static"],
               "median_vs_generate_batch": bool(gb) and result["median_ratio_generate_batch"]
               >= GOAL["median_vs_generate_batch"],
               "worst_vs_static": result["worst_ratio_static"] >= GOAL["worst_vs_static"],
               "steady_utilisation": bool(steady) and result["median_steady_utilisation"]
               >= GOAL["steady_utilisation"]}
        result["goal"] = {**GOAL, "met": met, "all_met": all(met.values())}
    measured = {k: v for k, v in weights.items() if v is not None}
    if measured:
        met = {k: v >= WEIGHTS_GOAL[k] for k, v in measured.items()}
        result["weights_goal"] = {**{k: WEIGHTS_GOAL[k] for k in measured}, "met": met,
                                  "all_met": all(met.values())}
