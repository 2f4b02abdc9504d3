"""The KV block pool as a grid of cells coloured by block state, virtualised like the tables.

One cell shows a run of ``blocks_per_cell`` consecutive blocks (1 when the pool fits the
screen; a small pool gets wider cells, up to ``MAX_CELL_WIDTH`` characters per block, so it
does not sit in one corner). A run is summarised, not sampled: the glyph says how much of it is not free
(``·`` none, ``░ ▒ ▓`` a third / two thirds / more, ``█`` all) and the colour says which state
is most common in it (used / cached / shared), so a fragmented pool still looks fragmented
when zoomed out. The summary is vectorised (numpy) and only visible lines become strips, so a
pool of a million blocks costs the same per refresh as a small one.

The age view (`age_view`, with the per-block ages of --kv-cache-metrics) keeps the glyphs and
colours each cell by the time since its most recently touched (allocated or hit) block that
is not free, in the bands of `AGE_BOUNDS`.
"""

from __future__ import annotations

import math

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

GLYPHS = "·░▒▓█"
STATE_NAMES = ("free", "used", "cached", "shared")
MAX_BLOCKS_PER_CELL = 1 << 24
MAX_CELL_WIDTH = 4
MIN_LEVEL = -2  # zoom level: blocks per cell = 2**level when >= 0, cell width 2**-level below
AGE_BOUNDS = (1.0, 10.0, 60.0, 600.0)   # seconds: bands < 1 s, < 10 s, < 1 min, < 10 min, older
AGE_LABELS = ("<1s", "<10s", "<1m", "<10m", "older")


def summarise(states: np.ndarray, per_cell: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of ``per_cell`` blocks: (glyph index 0..4, dominant state 0..3)."""
    n = len(states)
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    cells = math.ceil(n / per_cell)
    pad = cells * per_cell - n
    a = np.asarray(states, dtype=np.uint8)
    if pad:
        a = np.concatenate([a, np.full(pad, 255, np.uint8)])
    a = a.reshape(cells, per_cell)
    counts = np.stack([(a == s).sum(axis=1) for s in range(4)], axis=1)
    valid = counts.sum(axis=1)
    busy = valid - counts[:, 0]
    dominant = np.where(busy > 0, counts[:, 1:].argmax(axis=1) + 1, 0).astype(np.uint8)
    frac = busy / np.maximum(valid, 1)
    partial = 1 + np.minimum(2, (frac * 3).astype(np.int64))
    glyph = np.where(busy == 0, 0, np.where(busy == valid, 4, partial)).astype(np.uint8)
    return glyph, dominant


def age_bands(states: np.ndarray, ages: np.ndarray, per_cell: int) -> np.ndarray:
    """Per cell of ``per_cell`` blocks: 0 when every block is free, else 1 + the `AGE_BOUNDS`
    band of its youngest block that is not free (a block never touched counts as oldest)."""
    n = len(states)
    if n == 0:
        return np.zeros(0, np.uint8)
    cells = math.ceil(n / per_cell)
    a = np.full(cells * per_cell, np.inf, np.float64)
    age = np.nan_to_num(np.asarray(ages, np.float64), nan=np.inf)
    a[:n] = np.where(np.asarray(states) != 0, age, np.inf)
    youngest = a.reshape(cells, per_cell).min(axis=1)
    busy = (np.r_[np.asarray(states) != 0, np.zeros(cells * per_cell - n, bool)]
            .reshape(cells, per_cell).any(axis=1))
    band = np.searchsorted(np.asarray(AGE_BOUNDS), youngest, side="right") + 1
    return np.where(busy, band, 0).astype(np.uint8)


def age_counts(states: np.ndarray, ages: np.ndarray) -> list[int]:
    """Blocks that are not free, per `AGE_BOUNDS` band (never touched: oldest)."""
    busy = np.asarray(states) != 0
    age = np.nan_to_num(np.asarray(ages, np.float64)[busy], nan=np.inf)
    band = np.searchsorted(np.asarray(AGE_BOUNDS), age, side="right")
    return np.bincount(band, minlength=len(AGE_LABELS)).tolist()


def fit_blocks_per_cell(num_blocks: int, cells: int) -> int:
    """The smallest power of two that makes ``num_blocks`` fit in ``cells`` cells."""
    if num_blocks <= 0 or cells <= 0:
        return 1
    k = 1
    while math.ceil(num_blocks / k) > cells and k < MAX_BLOCKS_PER_CELL:
        k *= 2
    return k


def fit_level(num_blocks: int, width: int, height: int) -> int:
    """The zoom level that shows the whole pool in ``width`` x ``height`` characters, with
    cells as wide as possible (up to MAX_CELL_WIDTH) when the pool is small."""
    for level in range(MIN_LEVEL, 0):
        cw = 2 ** -level
        if width // cw and math.ceil(num_blocks / (width // cw)) <= height:
            return level
    k = fit_blocks_per_cell(num_blocks, width * height)
    return int(math.log2(k))


class KvGrid(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"kv-grid--free", "kv-grid--used", "kv-grid--cached",
                         "kv-grid--shared", "kv-grid--label",
                         *(f"kv-grid--age{i}" for i in range(len(AGE_LABELS)))}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.states: np.ndarray = np.zeros(0, np.uint8)
        self.ages: np.ndarray | None = None   # per block, seconds (--kv-cache-metrics)
        self.age_view = False
        self.zoom: int | None = None  # None = fit to the visible area
        self._glyph = np.zeros(0, np.uint8)
        self._dom = np.zeros(0, np.uint8)
        self._strips: dict[int, Strip] = {}
        self._shape: tuple[int, int, int] = (1, 1, 0)  # per_cell, cell width, width

    # --- geometry ----------------------------------------------------------------------------

    @property
    def label_width(self) -> int:
        return len(f"{max(0, len(self.states) - 1):,}") + 1

    @property
    def fit(self) -> int:
        """The zoom level that fits the visible area."""
        width = max(1, self.scrollable_content_region.width - self.label_width)
        height = max(1, self.scrollable_content_region.height)
        return fit_level(len(self.states), width, height)

    @property
    def level(self) -> int:
        return self.fit if self.zoom is None else self.zoom

    @property
    def blocks_per_cell(self) -> int:
        return 2 ** max(0, self.level)

    @property
    def cell_width(self) -> int:
        return 2 ** max(0, -self.level)

    @property
    def columns(self) -> int:
        """Cells per line."""
        return max(1, (self.scrollable_content_region.width - self.label_width) // self.cell_width)

    @property
    def rows(self) -> int:
        return math.ceil(len(self._glyph) / self.columns) if len(self._glyph) else 0

    def zoom_by(self, steps: int) -> str | None:
        """+1 zooms out (twice the blocks per cell), -1 zooms in. Returns why nothing changed
        (the zoom is at its end), else None."""
        top = max(0, math.ceil(math.log2(max(1, len(self.states)))))
        level = max(MIN_LEVEL, min(top, self.level + (1 if steps > 0 else -1)))
        if level == self.level:
            return self._zoom_end(steps)
        self.zoom = level
        self._rebuild()
        return None

    def _zoom_end(self, steps: int) -> str:
        """Why a zoom key did nothing: the cells are already as wide, or as full, as they go."""
        n = len(self.states)
        if n == 0:
            return "no block map to zoom"
        if steps < 0:
            return (f"already zoomed in as far as it goes: 1 block per cell, {self.cell_width} "
                    f"characters wide ({n:,} blocks)")
        return f"already zoomed out as far as it goes: all {n:,} blocks in one cell"

    def zoom_fit(self) -> None:
        self.zoom = None
        self._rebuild()

    # --- data --------------------------------------------------------------------------------

    def set_states(self, states: np.ndarray, ages: np.ndarray | None = None) -> None:
        self.states = states
        self.ages = ages if ages is not None and len(ages) == len(states) else None
        self._rebuild()

    def set_age_view(self, on: bool) -> None:
        self.age_view = on
        self._rebuild()

    @property
    def showing_ages(self) -> bool:
        return self.age_view and self.ages is not None

    def _rebuild(self) -> None:
        k = self.blocks_per_cell
        self._glyph, self._dom = summarise(self.states, k)
        if self.showing_ages:
            assert self.ages is not None
            self._dom = age_bands(self.states, self.ages, k)
        self._strips.clear()
        self._shape = (k, self.cell_width, self.scrollable_content_region.width)
        self.virtual_size = Size(self.scrollable_content_region.width, self.rows)
        self.refresh()

    def on_resize(self) -> None:
        self._rebuild()

    def counts(self) -> list[int]:
        return np.bincount(self.states, minlength=4)[:4].tolist() if len(self.states) else \
            [0, 0, 0, 0]

    # --- rendering ---------------------------------------------------------------------------

    def _styles(self) -> list[Style]:
        names = ["free", *(f"age{i}" for i in range(len(AGE_LABELS)))] if self.showing_ages \
            else STATE_NAMES
        return [self.get_component_rich_style(f"kv-grid--{name}") for name in names]

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        row = round(self.scroll_y) + y
        if row >= self.rows:
            return Strip.blank(width, self.rich_style)
        cached = self._strips.get(row)
        if cached is not None:
            return cached
        cols = self.columns
        k, cw = self._shape[0], self._shape[1]
        lo, hi = row * cols, min(len(self._glyph), (row + 1) * cols)
        glyph, dom = self._glyph[lo:hi], self._dom[lo:hi]
        styles = self._styles()
        label = f"{lo * k:>{self.label_width - 1},} "
        segments = [Segment(label, self.get_component_rich_style("kv-grid--label"))]
        code = glyph.astype(np.int64) * 8 + dom
        cuts = np.flatnonzero(np.diff(code)) + 1
        starts = np.r_[0, cuts]
        ends = np.r_[cuts, len(code)]
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            g = int(glyph[s])
            cell = GLYPHS[g] if cw == 1 else GLYPHS[g] * (cw - 1) + " "
            segments.append(Segment(cell * (e - s), styles[int(dom[s]) if g else 0]))
        strip = Strip(segments).adjust_cell_length(width, self.rich_style)
        self._strips[row] = strip
        return strip
