"""A preview of a Grafana dashboard without Grafana: every panel's PromQL run against a real
Prometheus (its HTTP API's range query), drawn as plain SVG in a page laid out by the
dashboard's ``gridPos``, and screenshot by headless Chromium.

    python -m vconsole.tools.dashboard_preview --prometheus http://127.0.0.1:9090 \\
        --dashboard examples/grafana/vconsole.json --since 30m --html out.html --png out.png

This is not Grafana: no Grafana code runs. It reads the dashboard JSON model as Grafana does
where the picture depends on it (rows, ``gridPos`` on Grafana's 24-column grid of 30 px rows
with 8 px gaps, ``timeseries`` and ``heatmap`` panels, each target's ``expr`` and
``legendFormat``, the unit, stacking, the template variables at "All") and draws the answers
itself. Grafana's interval variables are given Grafana's values: ``$__interval`` the range
query's step, ``$__rate_interval`` max(step + scrape interval, 4 x scrape interval).

`fetch` asks Prometheus (query errors stay with their panel, shown in it as Grafana shows
them); `render_html` draws what was fetched; `screenshot` runs ``chromium --headless
--screenshot``. Only the standard library.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vconsole.tools.dashboard_model import (
    PanelView,
    Preview,
    Series,
    fetch,
)

TITLE_PX = 30                # a panel's title bar
LEGEND_LINE_PX = 18
AXIS_LEFT_PX = 64
AXIS_BOTTOM_PX = 20
# Grafana's classic palette, in its order.
PALETTE = ("#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9",
           "#705DA0", "#37872D", "#FADE2A", "#447EBC", "#C15C17", "#890F02", "#0A437C")
# ColorBrewer's Spectral, low to high (the heatmap's scheme).
SPECTRAL = ("#9e0142", "#d53e4f", "#f46d43", "#fdae61", "#fee08b", "#ffffbf", "#e6f598",
            "#abdda4", "#66c2a5", "#3288bd", "#5e4fa2")
NOTICE = ("Preview drawn by vconsole.tools.dashboard_preview from the dashboard's JSON and a real "
          "Prometheus's answers to its queries: not Grafana")


# --- drawing ---------------------------------------------------------------------------------

_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _num(v: float) -> str:
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _si(v: float, unit: str) -> str:
    for scale, prefix in _SI:
        if abs(v) >= scale:
            return f"{_num(v / scale)} {prefix}{unit}"
    return f"{_num(v)} {unit}".rstrip()


def format_value(v: float, unit: str | None) -> str:
    """A value as Grafana's unit formats it (the units the dashboard uses)."""
    if not math.isfinite(v):
        return str(v)
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{_num(v * 1e6)} µs"
        if a < 1:
            return f"{_num(v * 1e3)} ms"
        if a < 60:
            return f"{_num(v)} s"
        return f"{_num(v / 60)} min" if a < 3600 else f"{_num(v / 3600)} hour"
    if unit == "percentunit":
        return f"{_num(v * 100)}%"
    if unit == "flops":
        return _si(v, "FLOP/s")
    if unit == "Bps":
        return _si(v, "B/s")
    if unit in (None, "", "short", "none"):
        for scale, suffix in ((1e9, " Bil"), (1e6, " Mil"), (1e3, " K")):
            if abs(v) >= scale:
                return f"{_num(v / scale)}{suffix}"
        return _num(v)
    return f"{_num(v)} {unit}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, count - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def _unit(panel: dict[str, Any]) -> str | None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    return None if unit is None else str(unit)


def _stacked(panel: dict[str, Any]) -> bool:
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    return bool(custom.get("stacking", {}).get("mode") == "normal")


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t))


def _legend_lines(names: Sequence[str], width: int) -> int:
    per_line = max(1, width // 170)
    return math.ceil(len(names) / per_line) if names else 0


def _timeseries_svg(view: PanelView, pre: Preview, w: int, h: int) -> str:
    series = [s for r in view.results for s in r.series]
    unit = _unit(view.panel)
    lines: list[tuple[Series, list[tuple[float, float]]]] = []
    if _stacked(view.panel):
        base: dict[float, float] = {}
        for s in series:
            pts = []
            for t, v in s.finite():
                base[t] = base.get(t, 0.0) + v
                pts.append((t, base[t]))
            lines.append((s, pts))
    else:
        lines = [(s, s.finite()) for s in series]
    values = [v for _, pts in lines for _, v in pts]
    lo = min([0.0, *values])
    hi = max([*values, lo + (1.0 if unit != "percentunit" else 0.01)])
    ticks = nice_ticks(lo, hi)
    lo, hi = ticks[0], ticks[-1]
    pw, ph = w - AXIS_LEFT_PX - 8, h - AXIS_BOTTOM_PX - 6

    def x(t: float) -> float:
        return AXIS_LEFT_PX + (t - pre.start) / max(1e-9, pre.end - pre.start) * pw

    def y(v: float) -> float:
        return 6 + ph - (v - lo) / (hi - lo) * ph

    out = [f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    for tv in ticks:
        out.append(f'<line x1="{AXIS_LEFT_PX}" x2="{AXIS_LEFT_PX + pw}" y1="{y(tv):.1f}" '
                   f'y2="{y(tv):.1f}" class="grid"/>')
        out.append(f'<text x="{AXIS_LEFT_PX - 6}" y="{y(tv) + 4:.1f}" class="ytick">'
                   f'{html.escape(format_value(tv, unit))}</text>')
    n_x = max(2, pw // 110)
    for i in range(n_x + 1):
        t = pre.start + (pre.end - pre.start) * i / n_x
        anchor = "start" if i == 0 else ("end" if i == n_x else "middle")
        out.append(f'<text x="{x(t):.1f}" y="{h - 4}" class="xtick" text-anchor="{anchor}">'
                   f'{_clock(t)}</text>')
    fill = _stacked(view.panel)
    for i in reversed(range(len(lines))) if fill else range(len(lines)):
        s, pts = lines[i]
        color = PALETTE[i % len(PALETTE)]
        for run in _runs(pts, 2.5 * pre.step):
            path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            if fill and len(run) > 1:
                below = lines[i - 1][1] if i > 0 else []
                floor = dict(below)
                back = " ".join(f"{x(t):.1f},{y(floor.get(t, 0.0)):.1f}" for t, _ in
                                reversed(run))
                out.append(f'<polygon points="{path} {back}" fill="{color}" '
                           f'fill-opacity="0.4" stroke="none"/>')
            if len(run) == 1:
                t, v = run[0]
                out.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2" fill="{color}"/>')
            else:
                out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                           f'stroke-width="1.5"/>')
    out.append("</svg>")
    return "".join(out)


def _runs(pts: list[tuple[float, float]], gap: float) -> list[list[tuple[float, float]]]:
    """Points split where the series has no sample for more than ``gap`` seconds."""
    runs: list[list[tuple[float, float]]] = []
    for t, v in pts:
        if runs and t - runs[-1][-1][0] <= gap:
            runs[-1].append((t, v))
        else:
            runs.append([(t, v)])
    return runs


def _spectral(f: float) -> str:
    return SPECTRAL[min(len(SPECTRAL) - 1, max(0, int(f * (len(SPECTRAL) - 1) + 0.5)))]


def heatmap_cells(series: Sequence[Series]) -> tuple[list[str], dict[float, list[float]]]:
    """Grafana's heatmap of Prometheus buckets (``format: heatmap``): the series ordered by
    ``le``, each bucket's count its cumulative count less the bucket below it's. Returns the
    bucket labels (low to high) and, per timestamp, the counts per bucket."""
    ordered = sorted(series, key=lambda s: float(s.labels.get("le", "inf")))
    labels = [s.labels.get("le", "") for s in ordered]
    by_time: dict[float, list[float]] = {}
    for i, s in enumerate(ordered):
        for t, v in s.finite():
            by_time.setdefault(t, [0.0] * len(ordered))[i] = v
    for row in by_time.values():
        for i in range(len(row) - 1, 0, -1):
            row[i] = max(0.0, row[i] - row[i - 1])
    return labels, by_time


def _heatmap_svg(view: PanelView, pre: Preview, w: int, h: int) -> str:
    series = [s for r in view.results for s in r.series]
    labels, by_time = heatmap_cells(series)
    pw, ph = w - AXIS_LEFT_PX - 8, h - AXIS_BOTTOM_PX - 6
    out = [f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    if labels:
        top = max((max(row) for row in by_time.values()), default=0.0) or 1.0
        cell_h = ph / len(labels)
        cell_w = max(1.0, pw * pre.step / max(1e-9, pre.end - pre.start))
        for t, row in sorted(by_time.items()):
            cx = AXIS_LEFT_PX + (t - pre.step - pre.start) / (pre.end - pre.start) * pw
            for i, count in enumerate(row):
                if count <= 0:
                    continue
                cy = 6 + ph - (i + 1) * cell_h
                out.append(f'<rect x="{max(AXIS_LEFT_PX, cx):.1f}" y="{cy:.1f}" '
                           f'width="{max(1.0, cell_w - 1):.1f}" height="{max(1.0, cell_h - 1):.1f}" '
                           f'fill="{_spectral(count / top)}"/>')
        every = max(1, math.ceil(len(labels) / max(1, ph // 14)))
        for i, le in enumerate(labels):
            if i % every == 0:
                cy = 6 + ph - (i + 0.5) * cell_h
                text = le if le in ("", "+Inf") else format_value(float(le), _unit(view.panel))
                out.append(f'<text x="{AXIS_LEFT_PX - 6}" y="{cy + 4:.1f}" class="ytick">'
                           f'{html.escape(text)}</text>')
    n_x = max(2, pw // 110)
    for i in range(n_x + 1):
        t = pre.start + (pre.end - pre.start) * i / n_x
        xx = AXIS_LEFT_PX + pw * i / n_x
        anchor = "start" if i == 0 else ("end" if i == n_x else "middle")
        out.append(f'<text x="{xx:.1f}" y="{h - 4}" class="xtick" text-anchor="{anchor}">'
                   f'{_clock(t)}</text>')
    out.append("</svg>")
    return "".join(out)


STYLE = """
body { margin: 0; background: #111217; color: #ccccdc; font: 13px Inter, Helvetica, Arial,
       sans-serif; }
.page { position: relative; }
.head { position: absolute; left: 16px; right: 16px; top: 10px; }
.head h1 { font-size: 18px; font-weight: 500; margin: 0 0 8px 0; color: #d8d9da; }
.vars span { background: #181b1f; border: 1px solid #2c3235; padding: 3px 8px; margin-right: 8px;
             font-size: 12px; }
.notice { margin-top: 8px; font-size: 12px; color: #8e8e8e; }
.panel { position: absolute; background: #181b1f; border: 1px solid #24292e; border-radius: 2px;
         overflow: hidden; box-sizing: border-box; }
.panel .title { height: 30px; line-height: 30px; padding: 0 8px; font-weight: 500;
                font-size: 13px; color: #d8d9da; white-space: nowrap; overflow: hidden; }
.row { position: absolute; font-size: 15px; font-weight: 500; color: #d8d9da; line-height: 30px;
       border-bottom: 1px solid #24292e; box-sizing: border-box; }
.legend { padding: 0 8px; font-size: 12px; display: flex; flex-wrap: wrap; }
.legend div { width: 170px; height: 18px; overflow: hidden; white-space: nowrap; }
.legend i { display: inline-block; width: 14px; height: 4px; margin: 0 6px 3px 0;
            vertical-align: middle; border-radius: 2px; }
.error { color: #f2495c; padding: 8px; font-size: 12px; }
.nodata { color: #8e8e8e; padding: 40px; text-align: center; }
svg text { fill: #9fa7b3; font-size: 11px; }
svg .ytick { text-anchor: end; }
svg .grid { stroke: #2c3235; stroke-width: 1; }
"""


def _panel_html(view: PanelView, pre: Preview) -> str:
    b = view.box
    style = f"left:{b.left}px;top:{b.top}px;width:{b.width}px;height:{b.height}px"
    attrs = f'data-panel-id="{view.id}" data-type="{html.escape(view.type)}" style="{style}"'
    if view.type == "row":
        return f'<div class="row" {attrs}>{html.escape(view.title)}</div>'
    body_h = b.height - TITLE_PX - 2
    errors = [r for r in view.results if r.error]
    series = [s for r in view.results for s in r.series]
    inner = ""
    if errors:
        inner = "".join(f'<div class="error">{html.escape(r.ref)}: {html.escape(r.error or "")}'
                        f"</div>" for r in errors)
    elif not any(s.finite() for s in series):
        inner = '<div class="nodata">No data</div>'
    elif view.type == "heatmap":
        inner = _heatmap_svg(view, pre, b.width - 2, body_h)
    else:
        names = [s.name for s in series]
        legend_h = _legend_lines(names, b.width - 18) * LEGEND_LINE_PX + 4
        inner = _timeseries_svg(view, pre, b.width - 2, max(40, body_h - legend_h))
        items = "".join(f'<div><i style="background:{PALETTE[i % len(PALETTE)]}"></i>'
                        f"{html.escape(n)}</div>" for i, n in enumerate(names))
        inner += f'<div class="legend">{items}</div>'
    return (f'<div class="panel" {attrs}><div class="title">{html.escape(view.title)}</div>'
            f"{inner}</div>")


def render_html(pre: Preview) -> str:
    """The page: the dashboard's title, its variables, the notice that this is a preview, and
    every panel at its place."""
    span = f"{_clock(pre.start)} to {_clock(pre.end)} UTC, step {pre.step:g} s"
    variables = "".join(f"<span>{html.escape(k)}: {html.escape(v)}</span>"
                        for k, v in pre.variables.items())
    panels = "\n".join(_panel_html(v, pre) for v in pre.panels)
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>'
            f"{html.escape(pre.title)}</title><style>{STYLE}</style></head><body>"
            f'<div class="page" style="width:{pre.width}px;height:{pre.height}px">'
            f'<div class="head"><h1>{html.escape(pre.title)}</h1><div class="vars">{variables}'
            f'<span>{span}</span></div><div class="notice">{html.escape(NOTICE)}</div></div>'
            f"\n{panels}\n</div></body></html>")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def screenshot(html_path: Path, png_path: Path, width: int, height: int,
               timeout_s: float = 120) -> None:
    """``chromium --headless --screenshot`` of the page at ``width`` x ``height``; RuntimeError
    when no Chromium is installed or it wrote nothing."""
    binary = find_chromium()
    if binary is None:
        raise RuntimeError("no chromium: apt-get install chromium")
    png_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="vconsole-chromium-") as profile:
        proc = subprocess.run(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--no-first-run", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             f"--screenshot={png_path}", html_path.resolve().as_uri()],
            capture_output=True, timeout=timeout_s)
    if not png_path.exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace')[-2000:]}")


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"a duration such as 30m, 90s or 1h, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.dashboard_preview",
                                description="Draw a Grafana dashboard's panels from a real "
                                "Prometheus (a preview, not Grafana).")
    p.add_argument("--prometheus", required=True, help="Prometheus's URL")
    p.add_argument("--dashboard", default="examples/grafana/vconsole.json", type=Path)
    p.add_argument("--since", type=_duration, default=_duration("30m"),
                   help="the time range, ending now (default 30m)")
    p.add_argument("--scrape-interval", type=_duration, default=_duration("15s"),
                   help="Prometheus's scrape interval, for $__rate_interval (default 15s)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--html", type=Path, default=Path("dashboard-preview.html"))
    p.add_argument("--png", type=Path, help="also screenshot it with headless Chromium")
    args = p.parse_args(argv)
    model = json.loads(args.dashboard.read_text())
    end = time.time()
    pre = fetch(model, args.prometheus, end - args.since, end,
                scrape_interval_s=args.scrape_interval, width=args.width)
    args.html.write_text(render_html(pre))
    failed = [(v.title, r.ref, r.error) for v in pre.panels for r in v.results if r.error]
    for title, ref, error in failed:
        print(f"{title} [{ref}]: {error}", file=sys.stderr)
    print(f"{args.html}: {len(pre.panels)} panels, "
          f"{sum(len(v.results) for v in pre.panels)} queries, {len(failed)} failed")
    if args.png is not None:
        screenshot(args.html, args.png, pre.width, pre.height)
        print(f"{args.png}: {pre.width}x{pre.height}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
