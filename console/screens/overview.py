"""Overview: the engine at a glance — queues, step phases, KV, GPU, host, latency and alerts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Static

from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets import panels
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.panels import Panel


class OverviewScreen(ConsoleScreen):
    MODE = "overview"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="overview"):
            yield Static(id="summary")
            with Horizontal(id="columns"):
                with Vertical(classes="column"):
                    yield Panel("Queues", id="queues")
                    yield Panel("Step phases", id="phases")
                    yield Panel("Host", id="host")
                with Vertical(classes="column"):
                    yield Panel("KV cache", id="kv")
                    yield Panel("GPU", id="gpu")
                    yield Panel(panels.latency_title(None), id="latency")
            yield Panel("Alerts", id="alerts")

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        eng = frame.engine
        now = frame.now
        self.query_one("#summary", Static).update(Content.from_markup(panels.summary(eng, now)))
        limits = self.console.limits()
        for pid, build in (("queues", panels.queues), ("phases", panels.phases),
                           ("kv", panels.kv), ("gpu", panels.gpu), ("host", panels.host),
                           ("latency", panels.latency)):
            panel = self.query_one(f"#{pid}", Panel)
            if eng is None:
                panel.show("[$text-muted]waiting for telemetry[/]")
            else:
                panel.show(build(eng, now, panel.inner_width, limits))
        self.query_one("#latency", Panel).border_title = panels.latency_title(eng)
        box = self.query_one("#alerts", Panel)
        box.show(panels.alerts(eng, state.alert_summary(now), now, box.inner_width))
        advice = state.advice(eng)
        more = f" (+{len(advice) - 1})" if len(advice) > 1 else ""
        box.border_subtitle = f"advice: {advice[0].title}{more} · a shows" if advice else ""
