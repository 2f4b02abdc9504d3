"""The three KV block residency distributions of ``--kv-cache-metrics`` as text lines: count,
p50 / p90 / p99 and a one-line histogram of each, from the ``step`` topic's ``kv_residency``
field (cumulative histograms with vLLM's bounds, `vconsole.engine.publish.block_residency`).

The percentiles are Prometheus's ``histogram_quantile`` (`vconsole.console.sources
.vllm_metrics.quantile`), so they read as a Grafana panel over the same series would."""

from __future__ import annotations

from math import inf
from typing import Any

from vconsole.console import format as fmt
from vconsole.console.sources.vllm_metrics import quantile

# (field of ``kv_residency``, label) in the order shown.
FIGURES = (("lifetime_s", "lifetime"), ("idle_before_evict_s", "idle before evict"),
           ("reuse_gap_s", "reuse gap"))
QUANTILES = (0.5, 0.9, 0.99)
BARS = " ▁▂▃▄▅▆▇█"
OFF = "block residency off: start the engine with --kv-cache-metrics"


def seconds(v: float | None) -> str:
    """Sub-second figures in ms (the buckets start at 1 ms), longer ones as durations."""
    if v is None:
        return "–"
    return fmt.ms(v) if v < 1 else fmt.duration(v)


def percentiles(hist: dict[str, Any]) -> list[float | None]:
    """p50, p90, p99 of one wire histogram (``bounds`` with +Inf, cumulative ``counts``)."""
    return [quantile(q, hist["bounds"], hist["counts"]) for q in QUANTILES]


def sparkline(counts: list[float]) -> str:
    """One character per bucket, its height the bucket's share of the fullest bucket."""
    per = [b - a for a, b in zip([0.0, *counts], counts, strict=False)]
    top = max(per, default=0)
    if top <= 0:
        return ""
    return "".join(" " if c <= 0 else BARS[max(1, round(c / top * (len(BARS) - 1)))]
                   for c in per)


def residency_lines(body: dict[str, Any] | None, width: int) -> list[str]:
    """Markup lines: a header and one line per distribution; `OFF` when the engine does not
    sample (``body`` None)."""
    if not body:
        return [f"[$text-muted]{OFF}[/]"]
    head = f"{'block residency':<17} {'samples':>8} {'p50':>8} {'p90':>8} {'p99':>8}"
    lines = [f"[b]{head}[/]"]
    for key, label in FIGURES:
        hist = body.get(key)
        if not hist:
            lines.append(f"{label:<17} {'–':>8}")
            continue
        ps = percentiles(hist)
        text = f"{label:<17} {fmt.count(hist.get('count')):>8} " + " ".join(
            f"{seconds(p):>8}" for p in ps)
        bar = sparkline(hist["counts"])
        if bar and len(text) + 2 + len(bar) <= width:
            text += f"  [$accent]{bar}[/]"
        lines.append(text)
    bounds = [b for b in (body.get(FIGURES[0][0]) or {}).get("bounds") or () if b != inf]
    scale = f"{seconds(bounds[0])}…{seconds(bounds[-1])}+" if bounds else ""
    if scale and len(head) + 2 + len(scale) <= width:
        lines[0] = f"[b]{head}[/]  [$text-muted]{scale}[/]"
    return lines
