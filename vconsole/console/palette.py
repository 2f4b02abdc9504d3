"""The command palette (ctrl+p): every console action by name (Posting's `commands.py`).

Actions that change the engine (editing a config key) are not offered on a read-only console,
so the palette can never do what the keys cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

from vconsole.console.keymap import SCREENS
from vconsole.console.requests_view import COLUMNS

if TYPE_CHECKING:
    from vconsole.console.app import VConsoleApp


class ConsoleCommands(Provider):
    def _commands(self) -> Iterator[tuple[str, Callable[[], object], str]]:
        app: VConsoleApp = self.app  # type: ignore[assignment]
        for mode, (key, title) in SCREENS.items():
            yield f"Go to {title}", partial(app.action_show, mode), f"screen {key}"
        yield ("Resume updates" if app.paused else "Pause updates",
               app.action_toggle_pause, "p: freeze the request table and KV map")
        yield ("Stop recording" if app.source.recording else "Start recording the telemetry "
               "stream", app.action_toggle_recording, "R: raw frames to a .vrec file")
        yield "Help: keys and legend", app.action_help, "?"
        yield "Go to Alerts", partial(app.action_show, "alerts"), "!: every alert heard"
        yield "Go to Advice", partial(app.action_show, "advice"), "a: tuning advice"
        yield ("What-if: predict a config change", partial(app.action_show, "whatif"),
               "w: the engine's last minutes of traffic, simulated with your edits")
        if app.check_action("show", ("profile",)):
            yield ("Profile the engine's next steps", partial(app.action_show, "profile"),
                   "P: torch.profiler over N steps (slows the engine while it runs)")
        if not app.readonly:
            for a in app.state.advice(app.current_engine()):
                if a.hot:
                    yield (f"Apply advice: {a.change_text()}", partial(self._apply_advice, a),
                           a.title)
        if app.steering.source_actions_allowed(app.source):
            for action in app.source.actions:
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
        yield "Quit", app.exit, "q"

    def _on_screen(self, mode: str, action: str, *args: object) -> None:
        app: VConsoleApp = self.app  # type: ignore[assignment]

        def run() -> None:
            screen = app.active_console_screen()
            if screen is not None and mode == screen.MODE:
                getattr(screen, f"action_{action}")(*args)
        if app.current_mode != mode:
            app.switch_mode(mode)
        app.call_after_refresh(run)

    def _apply_advice(self, advice: object) -> None:
        app: VConsoleApp = self.app  # type: ignore[assignment]
        reason = app.apply_advice(advice)
        if reason is not None:
            app.notify(reason, title="Advice", severity="warning")

    def _sort(self, key: str) -> None:
        app: VConsoleApp = self.app  # type: ignore[assignment]

        def run() -> None:
            screen = app.active_console_screen()
            if screen is not None and hasattr(screen, "set_sort"):
                screen.set_sort(key)
        if app.current_mode != "requests":
            app.switch_mode("requests")
        app.call_after_refresh(run)

    async def discover(self) -> Hits:
        for text, cmd, help_ in self._commands():
            yield DiscoveryHit(text, cmd, help=help_)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, cmd, help_ in self._commands():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), cmd, text=text, help=help_)
