"""KV map: the block pool, one cell per block or per run of blocks, with legend and zoom."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import KV
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.kv_grid import GLYPHS, KvGrid
from vconsole.console.widgets.panels import USAGE_CRIT, USAGE_WARN

SWATCH = {"used": "$success", "cached": "$primary", "shared": "$accent"}


class KvScreen(ConsoleScreen):
    MODE = "kv"
    BINDINGS = KV

    def compose_body(self) -> ComposeResult:
        yield Static(id="kv-legend")
        yield KvGrid(id="kv-grid")
        yield Static(id="kv-zoom")

    @property
    def grid(self) -> KvGrid:
        return self.query_one(KvGrid)

    def on_mount(self) -> None:
        self.grid.focus()

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        eng = frame.engine
        k = eng.latest.get("kv") if eng else None
        states = eng.block_states if eng else None
        grid = self.grid
        frozen = frame.paused and len(grid.states)
        if states is not None and not frozen and states is not grid.states:
            grid.set_states(states)
        legend = self.query_one("#kv-legend", Static)
        if k is None or states is None:
            legend.update(Content.from_markup("[$text-muted]no KV snapshot yet[/]"))
            self.query_one("#kv-zoom", Static).update("")
            return
        free, used, cached, shared = grid.counts()
        swatches = [f"[{SWATCH['used']}]█[/] used {used:,}",
                    f"[{SWATCH['cached']}]█[/] cached {cached:,}",
                    f"[{SWATCH['shared']}]█[/] shared {shared:,}",
                    f"[$text-muted]{GLYPHS[0]}[/] free {free:,}"]
        usage = k.get("usage")
        frag = k.get("fragmentation")
        limits = self.console.limits()
        metrics = [
            "usage " + fmt.styled(fmt.pct(usage), fmt.level(usage, USAGE_WARN, USAGE_CRIT)),
            "tokens " + fmt.styled(fmt.pct(k.get("token_usage")),
                                   fmt.level(k.get("token_usage"), USAGE_WARN, USAGE_CRIT)),
            "frag " + fmt.styled(fmt.pct(frag),
                                 fmt.level(frag, limits["fragmentation_threshold"])),
            "prefix hit " + fmt.pct(k.get("prefix_hit_rate")),
        ]
        paused = "  [$warning b]paused[/]" if frame.paused else ""
        legend.update(Content.from_markup("  ".join(swatches) + paused + "\n" +
                                          "  ".join(metrics)))
        self._show_zoom(k.get("block_size"))

    def _show_zoom(self, block_size: object) -> None:
        grid = self.grid
        per = grid.blocks_per_cell
        mode = "fit" if grid.zoom is None else ("zoomed in" if grid.level < grid.fit else
                                                "zoomed out" if grid.level > grid.fit else
                                                "fit size")
        cell = "1 cell = 1 block" if per == 1 else f"1 cell = {per:,} blocks"
        if grid.cell_width > 1:
            cell += f" ×{grid.cell_width} wide"
        text = (f"{cell} ({mode}) · {len(grid.states):,} blocks × {block_size} tokens")
        if per > 1:
            text += " · shade ░▒▓█ = share not free, colour = most common state"
        self.query_one("#kv-zoom", Static).update(Content(fmt.clip(text, max(10, self.size.width
                                                                          - 2))))

    def action_zoom(self, steps: int) -> None:
        self.grid.zoom_by(steps)
        self.console.refresh_view(force=True)

    def action_zoom_fit(self) -> None:
        self.grid.zoom_fit()
        self.console.refresh_view(force=True)
