"""KV map: the block pool, one cell per block or per run of blocks, with legend and zoom.

Data parallel: the map is the selected rank's pool (each rank has its own); ``[`` / ``]`` cycle
the rank and the bottom line names it. A lone engine has neither.

Above the map, the legend's third line says how the pool stores tokens (dtype, bytes per token,
capacity in tokens, pool bytes), when the source says it.

``A`` toggles the age view (an engine started with --kv-cache-metrics): the map coloured by the
time since each block was last allocated or hit, the legend counting blocks per age band, and
below the map the three residency distributions (lifetime, idle before evict, reuse gap)."""

from __future__ import annotations

import numpy as np
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import KV
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.kv_grid import AGE_LABELS, GLYPHS, KvGrid, age_counts
from vconsole.console.widgets.kv_residency import OFF, residency_lines
from vconsole.console.widgets.panels import USAGE_CRIT, USAGE_WARN, kv_storage, limits_of

SWATCH = {"used": "$success", "cached": "$primary", "shared": "$accent"}
AGE_TICK_S = 0.25     # the age view moves the ages of an idle engine on at most this often
AGE_SWATCH = ("$error", "$warning", "$success", "$primary", "$secondary")   # as app.tcss


class KvScreen(ConsoleScreen):
    MODE = "kv"
    BINDINGS = KV

    def __init__(self) -> None:
        super().__init__()
        self._dp = False      # a data-parallel group: [ ] cycle the rank shown
        self._rank = ""
        self._residency: dict | None = None   # the step topic's kv_residency, as shown
        self._aged = -1.0                     # seconds added to the shown ages

    def compose_body(self) -> ComposeResult:
        yield Static(id="kv-legend")
        yield KvGrid(id="kv-grid")
        yield Static(id="kv-residency")
        yield Static(id="kv-zoom")

    @property
    def grid(self) -> KvGrid:
        return self.query_one(KvGrid)

    def on_mount(self) -> None:
        self.grid.focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "rank":
            return self._dp
        return True

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        dp = frame.dp_size > 1
        if dp != self._dp:
            self._dp = dp
            self.refresh_bindings()
        eng = frame.engine
        self._rank = f"rank {eng.rank}/{frame.dp_size} · " if dp and eng is not None else ""
        k = eng.latest.get("kv") if eng else None
        states = eng.block_states if eng else None
        grid = self.grid
        frozen = frame.paused and len(grid.states)
        ages = eng.block_age_s if eng is not None else None
        if states is not None and not frozen:
            if grid.age_view and ages is not None and eng is not None:
                # The ages are as of the snapshot (an idle engine resends its last): grown here.
                since = eng.block_age_lag + max(0.0, frame.now - eng.recv_ts.get("kv",
                                                                                frame.now))
                if states is not grid.states or abs(since - self._aged) >= AGE_TICK_S:
                    self._aged = since
                    grid.set_states(states, ages + np.float32(since))
            elif states is not grid.states:
                grid.set_states(states, ages)
        if not frame.paused or self._residency is None:
            step = eng.latest.get("step") if eng is not None else None
            self._residency = (step or {}).get("kv_residency") or {}
        if grid.age_view:
            self.query_one("#kv-residency", Static).update(Content.from_markup("\n".join(
                residency_lines(self._residency, max(10, self.size.width - 2)))))
        legend = self.query_one("#kv-legend", Static)
        if k is not None and "block_states" in (k.get("not_exposed") or ()):
            legend.update(Content.from_markup(_no_block_map(k)))
            self.query_one("#kv-zoom", Static).update("")
            return
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
        limits = limits_of(state.config)
        metrics = [
            "usage " + fmt.styled(fmt.pct(usage), fmt.level(usage, USAGE_WARN, USAGE_CRIT)),
            "tokens " + fmt.styled(fmt.pct(k.get("token_usage")),
                                   fmt.level(k.get("token_usage"), USAGE_WARN, USAGE_CRIT)),
            "frag " + fmt.styled(fmt.pct(frag),
                                 fmt.level(frag, limits["fragmentation_threshold"])),
            "prefix hit " + fmt.pct(k.get("prefix_hit_rate")),
        ]
        if grid.showing_ages:
            assert grid.ages is not None
            bands = age_counts(grid.states, grid.ages)
            swatches = ["[b]age[/]", *(f"[{c}]█[/] {label} {n:,}" for c, label, n
                                       in zip(AGE_SWATCH, AGE_LABELS, bands, strict=True)),
                        f"[$text-muted]{GLYPHS[0]}[/] free {free:,}"]
        elif grid.age_view:
            swatches = [f"[$warning]no block ages: {OFF.split(': ', 1)[1]}[/]"]
        paused = "  [$warning b]paused[/]" if frame.paused else ""
        lines = ["  ".join(swatches) + paused, "  ".join(metrics)]
        storage = _storage(k, max(10, self.size.width - 2))
        if storage:
            lines.append(storage)
        legend.update(Content.from_markup("\n".join(lines)))
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
        text = (f"{self._rank}{cell} ({mode}) · {len(grid.states):,} blocks × {block_size} "
                f"tokens")
        if per > 1:
            text += " · shade ░▒▓█ = share not free, colour = most common state"
        self.query_one("#kv-zoom", Static).update(Content(fmt.clip(text, max(10, self.size.width
                                                                          - 2))))

    def action_zoom(self, steps: int) -> None:
        why = self.grid.zoom_by(steps)
        if why is not None:         # at the end of the zoom: say so rather than do nothing
            self.notify(why, title="KV map")
        self.console.refresh_view(force=True)

    def action_age(self) -> None:
        grid = self.grid
        grid.set_age_view(not grid.age_view)
        self._aged = -1.0
        self.query_one("#kv-residency", Static).set_class(grid.age_view, "-on")
        self.console.refresh_view(force=True)

    def action_rank(self, step: int) -> None:
        self.console.action_next_rank(step)

    def action_zoom_fit(self) -> None:
        self.grid.zoom_fit()
        self.console.refresh_view(force=True)


def _storage(k: dict, width: int) -> str:
    """``storage int8_per_token_head · 1,088 B/token · 4,096 tokens · pool 4.2MiB``: how the
    pool stores tokens (empty for an engine from before the KV dtypes)."""
    text = kv_storage(k, width - len("storage "))
    if not text:
        return ""
    pool = k.get("pool_bytes")
    if isinstance(pool, int) and len(text) + len(" · pool ") + len(fmt.nbytes(pool)) \
            <= width - len("storage "):
        text += f" · pool {fmt.nbytes(pool)}"
    return f"[$text-muted]storage[/] {fmt.escape(text)}"


def _no_block_map(k: dict) -> str:
    """The KV screen of a source without a block map (a vLLM server): what it does say, and the
    prefix cache as its KV event stream tells (``attach --vllm URL --kv-events EP``)."""
    lines = [f"[$text-muted]no block map: {fmt.escape(fmt.source_name(k.get('source')))} does "
             f"not expose one[/]",
             f"usage {fmt.pct(k.get('usage'))} of {fmt.count(k.get('num_blocks'))} blocks · "
             f"prefix hit {fmt.pct(k.get('prefix_hit_rate'))}"]
    pc = k.get("prefix_cache")
    if not pc:
        lines.append("[$text-muted]prefix cache contents: follow the KV events with "
                     "--kv-events[/]")
        return "\n".join(lines)
    bs = pc.get("block_size") or k.get("block_size")
    longest = ", ".join(f"{n} blocks" + (f" ({n * bs:,} tok)" if bs else "")
                        for n in pc.get("longest_prefixes_blocks") or []) or "–"
    lines += [f"[b]prefix cache[/] (KV events) cached {fmt.count(pc.get('cached_blocks'))} "
              f"blocks · stored {pc.get('stored_per_s', 0):.1f}/s · removed "
              f"{pc.get('removed_per_s', 0):.1f}/s · churn {fmt.pct(pc.get('churn'))}/s",
              f"longest cached prefixes: {longest}",
              f"[$text-muted]since start: stored {fmt.count(pc.get('stored_total'))} · removed "
              f"{fmt.count(pc.get('removed_total'))} · cleared {pc.get('cleared_total', 0)} · "
              f"gaps {pc.get('gaps', 0)} (replayed {pc.get('replayed', 0)})[/]"]
    return "\n".join(lines)
