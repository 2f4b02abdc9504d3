"""A Grafana dashboard's model as `dashboard_preview` draws it, and Prometheus's answers to its
queries: the panels placed on Grafana's grid (``gridPos``: 24 columns, rows of 30 px, 8 px
gaps), the template variables at "All", Grafana's interval variables (``$__interval`` the
range query's step, ``$__rate_interval`` max(step + scrape interval, 4 x scrape interval)),
each target's PromQL asked as a range query (an error stays with its panel) and named by its
``legendFormat``. Only the standard library."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

# Grafana's grid: 24 columns, rows of 30 px, 8 px between cells (react-grid-layout's margin).
COLUMNS = 24
ROW_PX = 30
GAP_PX = 8
PAGE_PAD_PX = 16
HEADER_PX = 96               # the page's title, the variables bar and the preview notice


@dataclass
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]          # (unix s, value); NaN kept as NaN
    name: str = ""                             # its legend, from the target's legendFormat

    def finite(self) -> list[tuple[float, float]]:
        return [(t, v) for t, v in self.points if math.isfinite(v)]


@dataclass
class QueryResult:
    ref: str
    expr: str                                  # as sent: variables replaced
    series: list[Series] = field(default_factory=list)
    error: str | None = None


@dataclass
class Box:
    left: int
    top: int
    width: int
    height: int


@dataclass
class PanelView:
    panel: dict[str, Any]
    box: Box
    results: list[QueryResult] = field(default_factory=list)

    @property
    def id(self) -> int:
        return int(self.panel.get("id", 0))

    @property
    def type(self) -> str:
        return str(self.panel.get("type", ""))

    @property
    def title(self) -> str:
        return str(self.panel.get("title", ""))


@dataclass
class Preview:
    title: str
    start: float
    end: float
    step: float
    variables: dict[str, str]                  # shown in the variables bar
    panels: list[PanelView]
    width: int

    @property
    def height(self) -> int:
        bottom = max((p.box.top + p.box.height for p in self.panels), default=HEADER_PX)
        return bottom + PAGE_PAD_PX


# --- the dashboard's model -------------------------------------------------------------------

def visible_panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels Grafana draws at first: the top-level list, rows included; a collapsed row
    keeps its panels in its own ``panels`` list, hidden until it is opened."""
    return list(model.get("panels", ()))


def layout(grid: dict[str, Any], width: int) -> Box:
    """A ``gridPos`` in pixels on a page ``width`` wide, as Grafana's grid places it."""
    inner = width - 2 * PAGE_PAD_PX
    col = (inner - (COLUMNS - 1) * GAP_PX) / COLUMNS
    x, y, w, h = (int(grid.get(k, 0)) for k in ("x", "y", "w", "h"))
    return Box(left=PAGE_PAD_PX + round(x * (col + GAP_PX)),
               top=HEADER_PX + y * (ROW_PX + GAP_PX),
               width=round(w * col + (w - 1) * GAP_PX),
               height=h * ROW_PX + (h - 1) * GAP_PX)


def rate_interval(step_s: float, scrape_interval_s: float) -> float:
    """Grafana's ``$__rate_interval``: max(``$__interval`` + scrape interval, 4 x scrape)."""
    return max(step_s + scrape_interval_s, 4 * scrape_interval_s)


def expand(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced, longest names first."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name,
                                                                        variables[name])
    return expr


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    """A series' name: the target's ``legendFormat`` with ``{{label}}`` filled in; without one,
    the series' labels as Prometheus prints them."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}",
                      lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest else (name or "value")


# --- asking Prometheus -----------------------------------------------------------------------

def query_range(url: str, expr: str, start: float, end: float, step: float,
                timeout_s: float = 30) -> list[Series]:
    """``/api/v1/query_range``'s matrix; RuntimeError with Prometheus's message on an error."""
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}",
                                     "end": f"{end:.3f}", "step": f"{step:g}"})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}",
                                    timeout=timeout_s) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    return [Series(dict(s["metric"]), [(float(t), float(v)) for t, v in s["values"]])
            for s in body["data"]["result"]]


def label_values(url: str, label: str, timeout_s: float = 10) -> list[str]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/label/"
                                f"{urllib.parse.quote(label)}/values", timeout=timeout_s) as r:
        return [str(v) for v in json.load(r).get("data", [])]


def dashboard_variables(model: dict[str, Any], url: str | None) -> tuple[dict[str, str],
                                                                          dict[str, str]]:
    """(the values put in the queries, the text of the variables bar): every query variable at
    "All" (its ``allValue``, else ``.*``), shown with the values Prometheus knows for it."""
    into: dict[str, str] = {}
    shown: dict[str, str] = {}
    for var in model.get("templating", {}).get("list", ()):
        name, label = var["name"], var.get("label") or var["name"]
        if var.get("type") == "datasource":
            into[name] = "prometheus"
            shown[label] = "Prometheus"
        elif var.get("type") == "query":
            into[name] = var.get("allValue") or ".*"
            known: list[str] = []
            if url is not None:
                try:
                    known = label_values(url, name)
                except (OSError, ValueError):
                    known = []
            shown[label] = "All" + (f" ({', '.join(known)})" if known else "")
    return into, shown


def fetch(model: dict[str, Any], url: str, start: float, end: float, *,
          scrape_interval_s: float, width: int = 1600, max_points: int = 240,
          rate_interval_s: float | None = None) -> Preview:
    """Every visible panel placed and every one of its targets asked over [start, end], at
    a step of (end - start) / ``max_points`` (at least the scrape interval).
    ``rate_interval_s``: ``$__rate_interval`` as a dashboard's user may pin it (default
    Grafana's, from the step and ``scrape_interval_s``)."""
    step = max(scrape_interval_s, math.ceil((end - start) / max_points))
    if rate_interval_s is None:
        rate_interval_s = rate_interval(step, scrape_interval_s)
    into, shown = dashboard_variables(model, url)
    into = {**into, "__interval": f"{step:g}s", "__rate_interval": f"{rate_interval_s:g}s",
            "__range": f"{end - start:.0f}s"}
    panels = []
    for panel in visible_panels(model):
        view = PanelView(panel, layout(panel.get("gridPos", {}), width))
        for target in panel.get("targets", ()) if panel.get("type") != "row" else ():
            expr = expand(target.get("expr", ""), into)
            result = QueryResult(str(target.get("refId", "")), expr)
            try:
                result.series = query_range(url, expr, start, end, step)
            except (RuntimeError, OSError, ValueError) as e:
                result.error = str(e)
            for s in result.series:
                s.name = legend(target.get("legendFormat"), s.labels)
            view.results.append(result)
        panels.append(view)
    return Preview(str(model.get("title", "")), start, end, step, shown, panels, width)
