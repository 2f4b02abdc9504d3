"""Trends: the engine's last 1, 5 or 15 minutes as plots — throughput, step time, queues, KV
usage and fragmentation, TTFT and ITL.

The data is the engine's `TrendHistory` (one point per second, kept by the data model from the same
stream as everything else), so the plots work alike live and from a replay. As many plots as fit
readably are shown at once: a 2×3 grid from 100×33 up, two stacked plots at 80×24; ``v`` / ``→``
pages through the rest. Plots are redrawn when a new second starts, the range or page changes,
or the engine changes — not on every message (Plotext builds are the costly part here).
"""

from __future__ import annotations

import math

from textual.app import ComposeResult
from textual.containers import Container
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import TRENDS
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.trend_plot import (
    COUNT,
    PERCENT,
    SECONDS,
    PlotSpec,
    TrendPlot,
)

RANGES_S = (60.0, 300.0, 900.0)
DEFAULT_RANGE = 1                    # 5 minutes
MIN_PLOT_HEIGHT = 10                 # rows a plot needs to be read (title, axes, ticks)
TWO_COLUMNS_WIDTH = 100
REDRAW_S = 1.0                       # the history's resolution: nothing new between seconds

PLOTS = (
    PlotSpec("tokens", "throughput (tokens/s)", (("tokens_per_s", "tokens/s"),), COUNT,
             "step"),
    PlotSpec("step", "step time", (("step_p50_s", "p50"), ("step_max_s", "max")), SECONDS,
             "step"),
    PlotSpec("queues", "queues", (("waiting", "waiting"), ("running", "running")), COUNT,
             "sched"),
    PlotSpec("kv", "KV cache", (("kv_usage", "usage"), ("fragmentation", "frag")), PERCENT,
             "kv"),
    PlotSpec("ttft", "TTFT", (("ttft_p99_s", "p99"), ("ttft_p50_s", "p50")), SECONDS,
             "latency", "no finished requests in this range"),
    PlotSpec("itl", "ITL", (("itl_p99_s", "p99"), ("itl_p50_s", "p50")), SECONDS, "latency",
             "no output tokens in this range"),
)


def range_label(window_s: float) -> str:
    return f"{window_s / 60:g} min"


class TrendsScreen(ConsoleScreen):
    MODE = "trends"
    BINDINGS = TRENDS

    def __init__(self) -> None:
        super().__init__()
        self.range_index = DEFAULT_RANGE
        self.page = 0
        self.columns, self.rows = 1, 2
        self._drawn: tuple[object, ...] | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="trends-bar")
        with Container(id="trends-grid"):
            for spec in PLOTS:
                yield TrendPlot(spec, id=f"trend-{spec.key}")

    # --- layout ------------------------------------------------------------------------------

    @property
    def window_s(self) -> float:
        return RANGES_S[self.range_index]

    @property
    def per_page(self) -> int:
        return min(len(PLOTS), self.columns * self.rows)

    @property
    def pages(self) -> int:
        return math.ceil(len(PLOTS) / self.per_page)

    def visible_plots(self) -> list[TrendPlot]:
        """The plots on the current page, in order."""
        start = self.page * self.per_page
        return [p for i, p in enumerate(self.query(TrendPlot)) if
                start <= i < start + self.per_page]

    def _layout(self) -> None:
        """Columns and rows that fit this terminal; hide the plots of other pages."""
        width, height = self.app.size
        avail = max(1, height - 3)                      # tab bar, range bar, footer
        columns = 2 if width >= TWO_COLUMNS_WIDTH else 1
        rows = max(1, min(math.ceil(len(PLOTS) / columns), avail // MIN_PLOT_HEIGHT))
        pages_before = self.pages
        self.columns, self.rows = columns, rows
        self.page = min(self.page, self.pages - 1)
        visible = self.visible_plots()
        grid = self.query_one("#trends-grid", Container)
        grid.styles.grid_size_columns = self.columns
        grid.styles.grid_size_rows = math.ceil(len(visible) / self.columns)  # a short last page
        shown = set(map(id, visible))
        for plot in self.query(TrendPlot):
            plot.display = id(plot) in shown
        if self.pages != pages_before:
            self.refresh_bindings()

    # --- the refresh -------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        self._layout()
        eng = frame.engine
        self._show_bar(frame)
        key = (int(frame.now // REDRAW_S), self.range_index, self.page, self.columns,
               self.rows, eng.key if eng is not None else None)
        if key == self._drawn:
            return
        self._drawn = key
        for plot in self.visible_plots():
            heard = eng is not None and plot.spec.topic in eng.latest
            plot.show(eng.trends if eng is not None else None, frame.now, self.window_s,
                      heard=heard)

    def _show_bar(self, frame: Frame) -> None:
        ranges = " ".join(f"[reverse b] {range_label(r)} [/]" if i == self.range_index
                          else f"[$text-muted] {range_label(r)} [/]"
                          for i, r in enumerate(RANGES_S))
        names = ", ".join(p.spec.title for p in self.visible_plots())
        parts = [ranges]
        if self.pages > 1:
            parts.append(f"plots {self.page + 1}/{self.pages}: {fmt.escape(names)}")
        lat = frame.engine.latest.get("latency") if frame.engine is not None else None
        if lat and isinstance(lat.get("window_s"), int | float):
            # A histogram's percentiles (vLLM's /metrics) are interpolated within buckets: the
            # Overview shows the ones known only as bounds as such; the plots draw estimates.
            what = (f"latency: {fmt.source_name(lat.get('source'))} histogram estimates over "
                    f"{lat['window_s']:g}s" if lat.get("source") == "vllm" else
                    f"latency over the engine's {lat['window_s']:g}s window")
            parts.append(f"[$text-muted]{what}[/]")
        parts.append("[$text-muted]1 point/s[/]")
        width = max(10, self.app.size.width - 2)
        self.query_one("#trends-bar", Static).update(
            Content.from_markup(fmt.fit(parts, width, "  ")))

    # --- actions -----------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "page":
            return self.pages > 1
        return True

    def action_next_range(self) -> None:
        self.action_set_range((self.range_index + 1) % len(RANGES_S))

    def action_set_range(self, index: int) -> None:
        self.range_index = index % len(RANGES_S)
        self.console.refresh_view(force=True)

    def action_page(self, step: int) -> None:
        if self.pages > 1:
            self.page = (self.page + step) % self.pages
            self.console.refresh_view(force=True)
