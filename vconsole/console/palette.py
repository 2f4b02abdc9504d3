"""The command palette (ctrl+p): every console action by name (Posting's `commands.py`).

Actions that change the engine (editing a config key) are not offered on a read-only console,
so the palette can never do what the keys cannot. The palette asks its host (`CommandHost`: a
screen's host and the app's own actions) and never imports the app.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from vconsole.console.keymap import SCREENS
from vconsole.console.requests_view import COLUMNS
from vconsole.console.screen_host import ScreenHost

if TYPE_CHECKING:
    from vconsole.console.screens.base import ConsoleScreen
    from vconsole.console.sources.source import Source
    from vconsole.console.state import EngineState


class CommandHost(ScreenHost, Protocol):
    """What the palette asks of the app beyond what a screen does: the app's own actions."""

    paused: bool

    def action_toggle_pause(self) -> None: ...

    def action_toggle_recording(self) -> None: ...

    def action_help(self) -> None: ...

    def action_next_engine(self) -> None: ...

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None: ...

    def is_dp(self) -> bool: ...

    def source_of(self, engine: EngineState | None) -> Source:
        """The source that feeds ``engine`` (its recording, its actions)."""

    def run_source_action(self, key: str, *, confirmed: bool = False) -> None: ...

    def edit_key(self, key: str) -> None: ...

    def active_console_screen(self) -> ConsoleScreen | None: ...


class ConsoleCommands(Provider):
    @property
    def host(self) -> CommandHost:
        return cast(CommandHost, self.app)

    def _commands(self) -> Iterator[tuple[str, Callable[[], object], str]]:
        app = self.host
        source = app.source_of(app.current_engine())
        for mode, (key, title) in SCREENS.items():
            yield f"Go to {title}", partial(app.action_show, mode), f"screen {key}"
        yield ("Resume updates" if app.paused else "Pause updates",
               app.action_toggle_pause, "p: freeze the request table and KV map")
        yield ("Stop recording" if source.recording else "Start recording the telemetry "
               "stream", app.action_toggle_recording, "R: raw frames to a .vrec file")
        yield "Help: keys and legend", app.action_help, "?"
        yield "Go to Alerts", partial(app.action_show, "alerts"), "!: every alert heard"
        yield "Go to Advice", partial(app.action_show, "advice"), "a: tuning advice"
        yield ("What-if: predict a config change", partial(app.action_show, "whatif"),
               "w: the engine's last minutes of traffic, simulated with your edits")
        yield ("What-if: calibrate the step costs", partial(self._on_screen, "whatif",
                                                            "calibrate"),
               "c: an engine of its own probes the batch shapes (never the live engine)")
        if app.check_action("show", ("profile",)):
            yield ("Profile the engine's next steps", partial(app.action_show, "profile"),
                   "P: torch.profiler over N steps (slows the engine while it runs)")
        if not app.readonly:
            for a in app.state.advice(app.current_engine()):
                if a.hot:
                    yield (f"Apply advice: {a.change_text()}", partial(self._apply_advice, a),
                           a.title)
        if app.steering.source_actions_allowed(source):
            for action in source.actions:
                yield (f"vLLM: {action.title}", partial(app.run_source_action, action.key),
                       f"POST {action.path} (asks for confirmation)")
        if len(app.state.engines) > 1:
            yield "Next engine", app.action_next_engine, "n"
        if app.is_dp():
            yield "Go to Ranks", partial(app.action_show, "dp"), "6: every rank of the group"
            yield "Next rank", partial(app.action_next_rank, 1), "]: on the KV map"
            yield "Previous rank", partial(app.action_next_rank, -1), "[: on the KV map"
        yield "Filter requests", partial(self._on_screen, "requests", "filter"), "/"
        yield "Clear the request filter", partial(self._on_screen, "requests",
                                                  "clear_filter"), "esc"
        yield ("Request detail: prompt head and output tail", partial(
            self._on_screen, "requests", "detail"), "enter on a row; esc closes")
        for col in COLUMNS:
            yield (f"Sort requests by {col.title}",
                   partial(self._sort, col.key), "s cycles the sort column")
        yield "Reverse the request sort", partial(self._on_screen, "requests",
                                                  "sort_reverse"), "r"
        yield "KV map: zoom in", partial(self._on_screen, "kv", "zoom", -1), "+"
        yield "KV map: zoom out", partial(self._on_screen, "kv", "zoom", 1), "-"
        yield "KV map: fit the pool to the screen", partial(self._on_screen, "kv",
                                                            "zoom_fit"), "0"
        yield "KV map: age view (block age and reuse)", partial(self._on_screen, "kv", "age"), "A"
        yield "Filter config keys", partial(self._on_screen, "config", "filter"), "/"
        for i, label in enumerate(("last minute", "last 5 minutes", "last 15 minutes")):
            yield (f"Trends: {label}", partial(self._on_screen, "trends", "set_range", i),
                   "t cycles the time range")
        yield "Trends: next plots", partial(self._on_screen, "trends", "page", 1), "v"
        if not app.readonly and app.state.config is not None:
            for row in app.state.config.schema:
                key = str(row.get("key"))
                yield (f"Edit config: {key}", partial(app.edit_key, key),
                       str(row.get("description", "")))
        yield "Quit", self.app.exit, "q"

    def _on_screen(self, mode: str, action: str, *args: object) -> None:
        def run() -> None:
            screen = self.host.active_console_screen()
            if screen is not None and mode == screen.MODE:
                getattr(screen, f"action_{action}")(*args)
        if self.app.current_mode != mode:
            self.app.switch_mode(mode)
        self.app.call_after_refresh(run)

    def _apply_advice(self, advice: object) -> None:
        host = self.host
        reason = host.steer(host.steering.plan_advice(advice, host.current_engine()))
        if reason is not None:
            self.app.notify(reason, title="Advice", severity="warning")

    def _sort(self, key: str) -> None:
        def run() -> None:
            screen = self.host.active_console_screen()
            if screen is not None and hasattr(screen, "set_sort"):
                screen.set_sort(key)
        if self.app.current_mode != "requests":
            self.app.switch_mode("requests")
        self.app.call_after_refresh(run)

    async def discover(self) -> Hits:
        for text, cmd, help_ in self._commands():
            yield DiscoveryHit(text, cmd, help=help_)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, cmd, help_ in self._commands():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), cmd, text=text, help=help_)
