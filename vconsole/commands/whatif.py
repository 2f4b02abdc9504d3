"""`vconsole whatif FILE --set K=V ... --compare 'K=V,K=V' [--validate] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vconsole.commands import fail
from vconsole.telemetry.request_trace import FIGURES, TraceError, read_trace
from vconsole.whatif.cost_model import TooLittleTraffic
from vconsole.whatif.predict import parse_assignments, whatif


def main(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.file)
        costs = read_trace(args.costs) if args.costs else None
    except TraceError as e:
        return fail("whatif", e, 2)
    try:
        variants = ([parse_assignments(args.set)] if args.set else []) + [
            parse_assignments([c]) for c in args.compare]
    except ValueError as e:
        return fail("whatif", e, 2)
    if costs is not None and costs.header.model and trace.header.model \
            and costs.header.model != trace.header.model:
        return fail("whatif", f"--costs was recorded on {costs.header.model!r}, the trace on "
                    f"{trace.header.model!r}: one model's step costs cannot time another's", 2)
    try:
        report = whatif(trace, variants, costs=costs)
    except (TooLittleTraffic, ValueError) as e:
        return fail("whatif", e, 2)
    except RuntimeError as e:        # a variant under which the simulation stalls
        return fail("whatif", e, 1)
    if args.validate:
        from vconsole.tools.whatif_validate import validate

        try:
            validate(trace, report, progress=None if args.json else _progress)
        except (RuntimeError, ValueError, OSError) as e:
            return fail("whatif", f"validation failed: {e}", 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_LABELS = {"output_tok_s": "output tok/s", "ttft_p50_s": "TTFT p50 s", "ttft_p99_s":
           "TTFT p99 s", "itl_p50_s": "ITL p50 s", "itl_p99_s": "ITL p99 s", "e2e_p50_s":
           "e2e p50 s", "preemptions": "preemptions", "kv_usage_peak": "KV peak"}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_report(report: dict[str, Any]) -> str:
    """A table that fits 80 columns: one row per figure; columns observed, baseline and each
    variant (#1, #2 ... named below); after --validate, each prediction is followed by the
    real engine's figure in parentheses."""
    base = report["baseline"]
    cols: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    if "observed" in base:
        cols.append(("observed", base["observed"], None))
    cols.append(("baseline", base["predicted"], base.get("validated")))
    legend = []
    for i, v in enumerate(report["variants"], 1):
        cols.append((f"#{i}", v["predicted"], v.get("validated")))
        legend.append(f"#{i}: " + ", ".join(f"{k}={val}" for k, val in v["set"].items()))
    validated = any(c[2] is not None for c in cols)
    width = 18 if validated else 10
    t = report["trace"]
    lines = [f"trace: {t['requests']} requests, {t['steps']} steps, {t['duration_s']:.1f} s "
             f"on {t['model']}",
             f"step-time model: {report['model']['num_steps']} steps, median error "
             f"{report['model']['rel_error']:.1%}" + ("; (real engine) after each prediction"
                                                      if validated else ""), ""]
    lines.append(f"{'':13s}" + "".join(f"{c[0]:>{width}s}" for c in cols))
    for k in FIGURES:
        row = f"{_LABELS[k]:13s}"
        for _, pred, real in cols:
            cell = _fmt(pred.get(k))
            if real is not None:
                cell += f" ({_fmt(real.get(k))})"
            row += f"{cell:>{width}s}"
        lines.append(row)
    lines += [""] + legend
    rejected = [f"#{i}" for i, v in enumerate(report["variants"], 1)
                if v["predicted"].get("rejected")]
    if rejected:
        lines.append(f"note: some requests can never run in the pool of {', '.join(rejected)} "
                     f"(counted as rejected, left out of the figures)")
    return "\n".join(lines)
