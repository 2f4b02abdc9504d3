"""Overview: the engine at a glance — queues, step phases, KV, GPU, host, latency and alerts.

Data parallel: the summary line is the group's (N ranks, summed tokens/s and queues), a "Data
parallel" panel on top shows the aggregate and each rank's load (imbalance highlighted), and the
other panels show the selected rank, which their titles name. The KV panel's bottom border says
how the pool stores tokens (dtype, bytes per token, capacity in tokens). A lone engine's Overview has
neither (the panel is not displayed), exactly as before.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets import dp_panels, panels
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.panels import Panel, limits_of

TITLES = {"queues": "Queues", "phases": "Step phases", "host": "Host", "kv": "KV cache",
          "gpu": "GPU"}


class OverviewScreen(ConsoleScreen):
    MODE = "overview"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="overview"):
            yield Static(id="summary")
            yield Panel("Data parallel", id="dp-panel")
            with Horizontal(id="columns"):
                with Vertical(classes="column"):
                    yield Panel(TITLES["queues"], id="queues")
                    yield Panel(TITLES["phases"], id="phases")
                    yield Panel(TITLES["host"], id="host")
                with Vertical(classes="column"):
                    yield Panel(TITLES["kv"], id="kv")
                    yield Panel(TITLES["gpu"], id="gpu")
                    yield Panel(panels.latency_title(None), id="latency")
            yield Panel("Alerts", id="alerts")

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        eng = frame.engine
        now = frame.now
        ranks = state.dp_ranks(eng) if frame.dp_size > 1 else []
        dp_box = self.query_one("#dp-panel", Panel)
        dp_box.display = bool(ranks)
        if ranks:
            agg = state.dp_aggregate(ranks, now)
            line = panels.dp_summary(eng, agg, now)
            dp_box.show(dp_panels.overview_panel(ranks, agg, dp_box.inner_width))
            dp_box.border_subtitle = "6 shows every rank"
        else:
            line = panels.summary(eng, now)
        self.query_one("#summary", Static).update(Content.from_markup(line))
        limits = limits_of(state.config)
        suffix = f" · rank {eng.rank}" if ranks and eng is not None else ""
        for pid, build in (("queues", panels.queues), ("phases", panels.phases),
                           ("kv", panels.kv), ("gpu", panels.gpu), ("host", panels.host),
                           ("latency", panels.latency)):
            panel = self.query_one(f"#{pid}", Panel)
            if pid in TITLES:
                panel.border_title = TITLES[pid] + suffix
            if eng is None:
                panel.show("[$text-muted]waiting for telemetry[/]")
            else:
                panel.show(build(eng, now, panel.inner_width, limits))
        self.query_one("#latency", Panel).border_title = panels.latency_title(eng) + suffix
        kv_box = self.query_one("#kv", Panel)
        kv_box.border_subtitle = fmt.escape(panels.kv_storage(
            eng.latest.get("kv") if eng is not None else None, kv_box.inner_width - 2))
        box = self.query_one("#alerts", Panel)
        box.show(panels.alerts(state.alerts_active(eng) if eng is not None else {},
                               state.alert_summary(now), now, box.inner_width))
        advice = state.advice(eng)
        more = f" (+{len(advice) - 1})" if len(advice) > 1 else ""
        box.border_subtitle = f"advice: {advice[0].title}{more} · a shows" if advice else ""
