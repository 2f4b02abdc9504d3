"""Stacks: what the engine process is doing right now — every thread and its Python stack.

For an engine that is slow rather than dead: every `REFRESH_S` seconds while this screen is
shown (and not paused, ``p``), a worker thread reads the stacks of the engine process (its pid
from the engine's ``health``) through `vconsole.shared.stacks` — py-spy where the OS lets it read
the engine, else the engine's own SIGUSR2 dump — and the screen shows them, the busy loop's
thread on top, each thread's name and then its frames (function, file:line), innermost first.
The line above says which method read them and when; where the OS refused py-spy it says what to
change. ``r`` reads them again now. Stacks are read on the engine's host: the engine's health
names its machine and its process's start (``host``, ``pid_start``), checked before the pid is
read (`vconsole.shared.stacks.check_identity`), so a console attached to a remote engine says
so ("the engine runs on HOST, not here") instead of showing a local process; a recording has
none.
"""

from __future__ import annotations

import time
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import STACKS
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.shared import stacks

REFRESH_S = 2.0


def engine_identity(frame: Frame) -> tuple[int, Any, int | None] | None:
    """(pid, host, pid_start) of the watched engine process from its health (host and start
    None from an engine that does not send them); None before the first heartbeat or while its
    supervisor restarts it."""
    eng = frame.engine
    if eng is None:
        return None
    health = eng.latest.get("health", {})
    pid = health.get("pid")
    if not isinstance(pid, int) or health.get("state") == "restarting":
        return None
    start = health.get("pid_start")
    return pid, health.get("host"), start if isinstance(start, int) else None


def report_lines(report: stacks.StackReport, width: int) -> list[str]:
    """Markup lines: per thread its name (the busy loop marked), then its frames."""
    lines: list[str] = []
    fn_w = max(16, min(48, width // 2))
    for t in report.threads:
        tag = " [$accent]busy loop[/]" if t.busy_loop else ""
        state = f" [$text-muted]{fmt.escape(t.state)}[/]" if t.state else ""
        lines.append(f"[b]{fmt.escape(fmt.clip(t.name, width - 20))}[/]{tag}{state}")
        if not t.frames:
            lines.append("  [$text-muted](no Python frame)[/]")
        for f in t.frames:
            where = f"{stacks.short_path(f.file)}:{f.line}"
            name = fmt.clip(f.function, fn_w)
            room = max(8, width - 4 - len(name))
            lines.append(f"  {fmt.escape(name)}  [$text-muted]{fmt.escape(fmt.clip(where, room))}"
                         "[/]")
        lines.append("")
    return lines


class StacksScreen(ConsoleScreen):
    MODE = "stacks"
    BINDINGS = STACKS

    def __init__(self) -> None:
        super().__init__()
        self.report: stacks.StackReport | None = None
        self.error: str | None = None
        self.pid: int | None = None
        self.ident: tuple[int, Any, int | None] | None = None
        self.fetching = False
        self._last_fetch = 0.0
        self._shown: tuple[Any, ...] = ()

    def compose_body(self) -> ComposeResult:
        yield Static(id="stacks-summary")
        with VerticalScroll(id="stacks-scroll"):
            yield Static(id="stacks-text")

    def on_mount(self) -> None:
        self.query_one("#stacks-scroll").focus()

    # --- data ------------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        ident = engine_identity(frame) if frame.live else None
        pid = ident[0] if ident is not None else None
        if pid != self.pid or ident != self.ident:
            self.pid, self.ident, self.report, self.error = pid, ident, None, None
            self._last_fetch = 0.0
        now = time.monotonic()
        if (ident is not None and not frame.paused and not self.fetching
                and now - self._last_fetch >= REFRESH_S):
            self._fetch(ident)
        self._draw(frame)

    def action_refresh(self) -> None:
        if self.ident is not None and not self.fetching:
            self._fetch(self.ident)

    def _fetch(self, ident: tuple[int, Any, int | None]) -> None:
        self.fetching = True
        self._last_fetch = time.monotonic()
        self.run_worker(lambda: self._read(ident), thread=True, group="stacks", exclusive=True)

    def _read(self, ident: tuple[int, Any, int | None]) -> None:
        """Worker thread: read the stacks (the engine's machine and start checked first),
        hand them to the UI thread."""
        pid, host, start = ident
        report, error = None, None
        try:
            report = stacks.capture(pid, host=host, start=start)
        except stacks.StacksError as e:
            error = str(e)
        except Exception as e:  # never take the console down
            error = f"{type(e).__name__}: {e}"
        self.app.call_from_thread(self._got, pid, report, error)

    def _got(self, pid: int, report: stacks.StackReport | None, error: str | None) -> None:
        self.fetching = False
        if pid != self.pid:
            return
        self.report, self.error = report, error
        self._last_fetch = time.monotonic()
        self.console.refresh_view(force=True)

    # --- drawing ---------------------------------------------------------------------------

    def _draw(self, frame: Frame) -> None:
        width = max(40, self.query_one("#stacks-scroll").content_size.width - 1)
        r = self.report
        key = (self.pid, id(r), self.error, frame.live, frame.paused, width,
               int(time.time() - r.taken_ts) if r else None, self.fetching and r is None)
        if key == self._shown:
            return
        self._shown = key
        self.query_one("#stacks-summary", Static).update(
            Content.from_markup(self._summary(frame, width)))
        body = report_lines(r, width) if r is not None else []
        self.query_one("#stacks-text", Static).update(Content.from_markup("\n".join(body)))

    def _summary(self, frame: Frame, width: int) -> str:
        if not frame.live:
            return ("[$text-muted]Stacks are read from a live engine process; a recording has "
                    "none.[/]")
        if self.pid is None:
            return "[$text-muted]waiting for the engine's health (its process id)…[/]"
        r = self.report
        lines = []
        if self.error:
            lines.append(f"[$error]no stacks of pid {self.pid}:[/] {fmt.escape(self.error)}")
        if r is None:
            if not self.error:
                lines.append(f"[$text-muted]reading the stacks of pid {self.pid}…[/]")
            return "\n".join(lines)
        age = max(0.0, time.time() - r.taken_ts)
        paused = " · [$warning]paused[/]" if frame.paused else ""
        lines.insert(0, f"pid [b]{r.pid}[/] · {len(r.threads)} threads · by "
                        f"[b]{fmt.escape(r.method)}[/] · {fmt.duration(age)} ago{paused} · "
                        f"[$text-muted]r reads again[/]")
        if r.note:
            lines.append(f"[$text-muted]{fmt.escape(fmt.clip(r.note, width * 3))}[/]")
        return "\n".join(lines)
