"""One Trends plot: a few lines of an engine's `TrendHistory` over the chosen time range.

A `PlotextPlot` (textual-plotext) that is told what to draw by `TrendPlot.show`; it draws when
Textual renders it, at its current size, so a resize needs no new data. The x axis is seconds
before now (ticks ``-5m … now``); the y axis starts at zero, so a flat line means "steady", not
"noisy". With nothing to draw the plot says why inside its frame instead of showing empty axes.

Test hooks: ``drawn`` (points drawn per line label), ``message`` (the text shown instead of
lines, or None), ``unit`` (the y axis unit in use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from textual_plotext import PlotextPlot

from vconsole.console.trend_history import TrendHistory

# Plotext colour names: native ANSI colours, so the 16-colour theme keeps them apart.
COLOURS = ("cyan+", "orange+", "green+", "magenta+")
SECONDS, PERCENT, COUNT = "s", "%", ""


@dataclass(frozen=True)
class PlotSpec:
    """What one plot shows: ``lines`` are (trend name, legend label); ``kind`` picks the y
    scale (seconds shown as ms or s, a 0..1 share as %, or plain numbers)."""

    key: str
    title: str
    lines: tuple[tuple[str, str], ...]
    kind: str = COUNT
    topic: str = ""          # the topic feeding it, to say "no <topic> data" when unheard
    empty: str = "no samples in this range"


def x_ticks(window_s: float) -> tuple[list[float], list[str]]:
    """Ticks in whole units from ``-window`` to ``now``: ``-60s -45s … now``, ``-5m -4m …``."""
    step = 15.0 if window_s <= 60 else 60.0 if window_s <= 300 else 180.0
    n = max(1, round(window_s / step))
    ticks = [-step * (n - i) for i in range(n + 1)]
    labels = ["now" if t == 0 else f"{t / 60:g}m" if window_s > 60 else f"{t:g}s"
              for t in ticks]
    return ticks, labels


def y_ticks(peak: float, n: int = 4) -> tuple[list[float], list[str]]:
    """About ``n`` round steps from 0 to at least ``peak`` (1/2/2.5/5 × 10^k), labelled
    compactly (``12k``, ``0.5``), so the axis stays narrow and readable."""
    raw = max(peak, 1e-9) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    count = max(1, math.ceil(peak / step - 1e-9))
    ticks = [i * step for i in range(count + 1)]
    return ticks, [_compact(t) for t in ticks]


def _compact(v: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


class TrendPlot(PlotextPlot):
    def __init__(self, spec: PlotSpec, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="trend-plot")
        # Plotext's "clear" theme draws frame, ticks and title in the terminal's default colours,
        # so the widget's CSS (the app theme, truecolour or 16-colour ANSI) decides them.
        self.theme = "clear"
        self.spec = spec
        self.drawn: dict[str, int] = {}
        self.message: str | None = None
        self.unit = ""

    def show(self, history: TrendHistory | None, now: float, window_s: float,
             heard: bool = True) -> None:
        """Plot the spec's lines over ``[now - window_s, now]``; ``heard``: the engine has sent
        the plot's topic at all (else the plot says "no <topic> data")."""
        spec = self.spec
        plt = self.plt
        plt.clear_figure()
        series: list[tuple[str, np.ndarray, np.ndarray]] = []
        if history is not None:
            for name, label in spec.lines:
                t, v = history[name].points(now, window_s)
                series.append((label, t - now, v))
        self.drawn = {label: int(len(x)) for label, x, _ in series}
        peak = max((float(v.max()) for _, _, v in series if len(v)), default=None)
        scale, self.unit = self._scale(peak) if peak is not None else (1.0, "")
        title = spec.title + (f" ({self.unit})" if self.unit else "")
        plt.title(title)
        ticks, labels = x_ticks(window_s)
        plt.xlim(-window_s, 0)
        plt.xticks(ticks, labels)
        if peak is None:
            if history is None:
                self.message = "waiting for telemetry"
            elif not heard:
                self.message = f"no {spec.topic} data"
            else:
                self.message = spec.empty
            plt.ylim(0, 1)
            plt.yticks([])
            plt.text(self.message, -window_s / 2, 0.5, alignment="center", color="default",
                     background="default")
        else:
            self.message = None
            yt, ylabels = y_ticks(100.0 if spec.kind == PERCENT else peak * scale)
            plt.ylim(0, yt[-1])
            plt.yticks(yt, ylabels)
            for (label, x, v), colour in zip(series, COLOURS, strict=False):
                if len(x):
                    plt.plot(x.tolist(), (v * scale).tolist(), color=colour, marker="braille",
                             label=label if len(series) > 1 else None)
        self.refresh()

    def _scale(self, peak: float | None) -> tuple[float, str]:
        kind = self.spec.kind
        if kind == SECONDS:
            return (1.0, "s") if peak is not None and peak >= 1.0 else (1000.0, "ms")
        if kind == PERCENT:
            return 100.0, "%"
        return 1.0, ""
