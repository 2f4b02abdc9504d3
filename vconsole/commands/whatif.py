"""`vconsole whatif FILE --set K=V ... --compare 'K=V,K=V' [--validate] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from vconsole.commands import fail
from vconsole.telemetry.request_trace import FIGURES, TraceError, read_trace
from vconsole.whatif.calibration import calibration_path
from vconsole.whatif.cost_model import TooLittleTraffic
from vconsole.whatif.overload import GROWS, verdict_line, wait_mark
from vconsole.whatif.predict import (
    KV_BLOCKS,
    ROW_LABELS,
    ROWS,
    change_rel,
    parse_assignments,
    pct,
    rough_heading,
    rough_note,
    tolerance,
    whatif,
)


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
    calibration = None
    calib_path = calibration_path(args.file)
    if args.calibrate:
        from vconsole.tools.whatif_calibrate import calibrate

        try:
            calib_path, calibration = calibrate(trace, args.file, variants,
                                                progress=None if args.json else _progress)
        except (TooLittleTraffic, RuntimeError, ValueError, OSError) as e:
            return fail("whatif", f"calibration failed: {e}", 1)
    elif calib_path.exists():
        try:
            calibration = read_trace(calib_path)
        except TraceError as e:
            return fail("whatif", f"the calibration beside the trace is unusable: {e}", 2)
    try:
        report = whatif(trace, variants, costs=costs, calibration=calibration,
                        intervals=not args.no_intervals)
    except (TooLittleTraffic, ValueError) as e:
        return fail("whatif", e, 2)
    except RuntimeError as e:        # a variant under which the simulation stalls
        return fail("whatif", e, 1)
    if calibration is not None:
        report["model"]["calibration"] = {"file": str(calib_path),
                                          "steps": len(calibration.steps)}
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


WIDTH = 80              # the text report fits a terminal this wide
GAP = "  "
MARK = "!"              # beside a prediction of a figure the model misses on the baseline


def figure(key: str, fig: dict[str, Any]) -> str:
    """One figure with its unit: ``372.5`` (the row says tok/s), ``45.8 ms``, ``1.28 s``,
    ``5.2%`` (of the pool), ``424/8,192`` (blocks), ``-`` when unknown."""
    v = fig.get(key)
    if key == KV_BLOCKS:
        pool = fig.get("num_kv_blocks")
        return "-" if v is None else f"{v:,}/{pool:,}" if pool else f"{v:,}"
    if v is None:
        return "-"
    if key == "output_tok_s":
        return f"{v:,.1f}"
    if key == "kv_usage_peak":
        return f"{v:.1%}"
    if key.endswith("_s"):
        ms = v * 1000
        if ms < 1000:
            return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
        return f"{v:.2f} s" if v < 10 else f"{v:.1f} s" if v < 100 else f"{v:,.0f} s"
    return f"{v:,}"


class _Column:
    """A column of the table: header lines (bottom-aligned) over sub-columns of cells, each
    right-aligned to its own width (a value, its change, its marker)."""

    def __init__(self, head: str, parts: list[list[str]]) -> None:
        self.parts = [p for p in parts if any(p)]
        inner = self._inner()
        self.head = textwrap.wrap(head, width=max(inner, 13), break_long_words=False,
                                  break_on_hyphens=False)
        self.width = max(inner, *(len(h) for h in self.head))

    def _inner(self) -> int:
        return sum(max(map(len, p)) for p in self.parts) + len(self.parts) - 1

    def cell(self, row: int) -> str:
        return " ".join(f"{p[row]:>{max(map(len, p))}}" for p in self.parts)


def _table(labels: list[str], columns: list[_Column]) -> list[str]:
    lw = max(map(len, labels))
    height = max(len(c.head) for c in columns)
    lines = []
    for i in range(height):
        heads = [(c.head[i - height + len(c.head)] if i >= height - len(c.head) else "")
                 for c in columns]
        lines.append(" " * lw + "".join(f"{GAP}{h:>{c.width}}" for h, c in zip(heads, columns,
                                                                              strict=True)))
    for r, label in enumerate(labels):
        lines.append(f"{label:<{lw}}" + "".join(f"{GAP}{c.cell(r):>{c.width}}"
                                               for c in columns))
    return [line.rstrip() for line in lines]


def _tables(labels: list[str], first: list[_Column], reference: _Column,
            units: list[list[_Column]]) -> list[str]:
    """``first`` then as many ``units`` (a variant's columns: kept together) as fit `WIDTH`;
    the others in further tables, each beside ``reference`` (predicted now: what their
    changes are against)."""
    lw = max(map(len, labels))

    def width(cols: list[_Column]) -> int:
        return lw + sum(len(GAP) + c.width for c in cols)

    lines: list[str] = []
    group = list(first)
    for unit in units:
        if width(group + unit) > WIDTH and group != [reference]:
            lines += _table(labels, group) + [""]
            group = [reference]
        group += unit
    return lines + _table(labels, group)


def _named(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def format_report(report: dict[str, Any]) -> str:
    """The what-if as an operator reads it, within 80 columns: a row per figure; columns
    ``observed`` (the trace), ``predicted now`` (the trace's own config, simulated), ``now vs
    observed`` (the model's error on this very trace), then ``predicted K=V`` per variant with
    its change against predicted now. A prediction of a figure the model misses on the
    baseline by more than its stated error carries `MARK`, and a line below says so. After
    --validate, ``real engine`` columns: the real figure and the prediction's error on it."""
    base, variants = report["baseline"], report["variants"]
    model = report["model"]
    flagged = set(base.get("rough", []))
    obs = base.get("observed")
    labels = [ROW_LABELS[k] for k in ROWS]

    def marks() -> list[str]:
        return [MARK if k in flagged else "" for k in ROWS]

    def real(entry: dict[str, Any]) -> _Column | None:
        """The real engine's figures beside the prediction they check (--validate)."""
        if entry.get("validated") is None:
            return None
        err = entry.get("validation_error") or {}
        return _Column("real engine", [
            [figure(k, entry["validated"]) for k in ROWS],
            [f"({pct(err.get(k))})" if k in FIGURES else "" for k in ROWS]])

    def wait(entry: dict[str, Any], variant: bool, k: str) -> str:
        """`wait_mark` of a figure: ``grows`` (a variant's only: the trace's own config is
        shown as it ran), ``grows?`` or ""."""
        mark = wait_mark(k, entry.get("overload"))
        return "" if mark == GROWS and not variant else mark

    def stated(entry: dict[str, Any], variant: bool) -> list[str]:
        """Each figure's interval as its relative half-width (``±4.2%``); none beside an
        overloaded variant's ``grows``, and ``grows?`` for a wait near capacity (the queue
        may grow: no interval bounds it)."""
        st = (entry.get("interval") or {}).get("stated") or {}
        out = []
        for k in ROWS:
            mark = wait(entry, variant, k)
            out.append("" if mark == GROWS else mark or (
                tolerance(st[k]) if k in FIGURES and st.get(k) is not None else ""))
        return out

    def values(entry: dict[str, Any], variant: bool) -> list[str]:
        """The predicted figures; an overloaded variant's waits read ``grows`` (a figure of
        the trace's length, not of the config)."""
        return [GROWS if wait(entry, variant, k) == GROWS else figure(k, entry["predicted"])
                for k in ROWS]

    now = _Column("predicted now", [values(base, False), stated(base, False), marks()])
    first: list[_Column] = []
    if obs is not None:
        first.append(_Column("observed", [[figure(k, obs) for k in ROWS]]))
    first.append(now)
    if obs is not None:
        error = base.get("error") or {}
        first.append(_Column("now vs observed", [[pct(error.get(k)) if k in FIGURES else ""
                                                  for k in ROWS]]))
    if (col := real(base)) is not None:
        first.append(col)
    units: list[list[_Column]] = []
    for v in variants:
        change = change_rel(v["predicted"], base["predicted"])
        units.append([_Column(f"predicted {_named(v['set'])}", [
            values(v, True),
            [pct(change.get(k)) if k in FIGURES and change.get(k) is not None
             and wait(v, True, k) != GROWS else "" for k in ROWS],
            stated(v, True), marks()])])
        if (col := real(v)) is not None:
            units[-1].append(col)

    t = report["trace"]
    calib = model.get("calibration")
    of_calib = f" ({calib['steps']:,} of a calibration's)" if calib else ""
    lines = [f"trace: {t['requests']:,} requests, {t['steps']:,} steps, {t['duration_s']:.1f} s "
             f"on {t['model']}",
             f"step-time model: fitted on {model['num_steps']:,} steps{of_calib}, median error "
             f"{tolerance(model['rel_error'])} per step"]
    shape_err = model.get("shape_error")
    if shape_err:
        lines.append(f"per batch shape: {tolerance(shape_err['inside'])} on the shapes it "
                     f"was fitted on, {tolerance(shape_err['outside'])} beyond them")
    named = [("the trace's own config", base)] + [(_named(v["set"]), v) for v in variants]
    for name, entry in named:
        if said := verdict_line(name, entry.get("overload")):
            lines += textwrap.wrap(said, WIDTH, subsequent_indent="  ")
    if obs is None:
        lines.append("no observed figures (a CSV trace): nothing checks the baseline")
    else:
        lines.append("predicted now: the trace's own config, simulated; now vs observed: its "
                     "error")
    if variants:
        lines.append("predicted K=V: the change, simulated; its % is against predicted now")
    if base.get("interval"):
        lines.append("±: each prediction's interval (noise reseeded, step costs moved by "
                     "their error)")
    if any(e.get("validated") is not None for e in (base, *variants)):
        lines.append("real engine: that config run on the trace; (%): the prediction's error")
    lines += [""] + _tables(labels, first, now, units)
    per_figure = ((base.get("interval") or {}).get("stated")) or None
    notes = [rough_note(k, base["error"][k], per_figure.get(k) if per_figure else None)
             for k in FIGURES if k in flagged]
    if notes:
        lines += ["", f"{MARK} {rough_heading(None if per_figure else model['rel_error'])}"]
    for note in notes:
        lines += textwrap.wrap(note, WIDTH, initial_indent="  ", subsequent_indent="    ")
    for name, entry in named:
        cov = entry.get("coverage") or {}
        if cov.get("warn"):
            eg = f" (e.g. {cov['examples'][0]})" if cov.get("examples") else ""
            err = f", where its error is {tolerance(shape_err['outside'])}" if shape_err else ""
            lines += [""] + textwrap.wrap(
                f"outside the fit: {cov['share']:.0%} of the steps of {name} are of batch "
                f"shapes the step-time model was not fitted on{eg}{err}; measure them with "
                f"--calibrate", WIDTH)
    rejected = [_named(v["set"]) for v in variants if v["predicted"].get("rejected")]
    if rejected:
        lines += [""] + textwrap.wrap(
            f"note: some requests can never run in the pool of {'; '.join(rejected)} "
            f"(counted as rejected, left out of the figures)", WIDTH)
    return "\n".join(lines)
