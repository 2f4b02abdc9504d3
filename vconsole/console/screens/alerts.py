"""Alerts: every alert this console heard, newest first, and the ones active now.

The Overview keeps one line per alerting figure in a small panel; here is the whole history
(the last ``ALERT_HISTORY`` events of every engine watched): when, which engine, the level, the
figure, its value against the threshold and the engine's message. The selected alert's full
message sits below the table, since a long one does not fit a row at 80 columns. ``/`` filters
(words match the name, level, engine or message), ``esc`` clears. Engine restarts and the
outcome of advice applied from this console are listed too; they are events, never active.
A restart of a hung engine names the file its supervisor wrote the stacks into (``stacks:
PATH``); when that file is readable here (the console on the engine's host), the detail adds
the busy loop's innermost frames from it: where the engine hung. Only a regular file in
the hang folder (`vconsole.shared.stacks.hang_dir`) is read, size-capped and non-blocking.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import DataTable, Input, Static

from vconsole.console import format as fmt
from vconsole.console.engine_state import Alert
from vconsole.console.keymap import ALERTS
from vconsole.console.screens.base import row_table
from vconsole.console.screens.filtered import FilteredScreen
from vconsole.console.state import ALERT_HISTORY, ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.shared import stacks
from vconsole.telemetry.printable import printable

LEVEL_STYLE = {"critical": "bold red", "warning": "yellow", "ok": "green"}
LEVEL_MARKUP = {"critical": "$error", "warning": "$warning", "ok": "$success"}
_STACKS = re.compile(r"stacks: (\S+)")
_FRAME = re.compile(r"^    (\S.*) \((.*)\)$")


def stacks_path(message: str) -> str | None:
    """The stacks file a hung engine's restart event names, if any."""
    m = _STACKS.search(message)
    return m.group(1) if m else None


def busy_loop_frames(path: str, limit: int = 3, folder: Path | None = None) -> list[str]:
    """``function (file:line)`` of the busy loop's innermost frames in a stacks file (the
    first thread: `vconsole.shared.stacks.StackReport.render` puts it there); [] when the file
    cannot be read here. Only a regular file in the hang folder is read
    (`vconsole.shared.stacks.read_hang_file`): the path comes from a telemetry message."""
    text = stacks.read_hang_file(path, folder)
    if text is None:
        return []
    frames: list[str] = []
    in_first = False
    for line in text.splitlines():
        if line.startswith('Thread "'):
            if in_first:
                break
            in_first = "busy loop" in line
        elif in_first and (m := _FRAME.match(line)):
            frames.append(f"{m.group(1)} ({m.group(2)})")
            if len(frames) >= limit:
                break
    return frames


def matches(alert: Alert, words: list[str]) -> bool:
    """Every word must appear in the alert's name, level, engine or message."""
    hay = f"{alert.name} {alert.level} {alert.engine}/{alert.rank} {alert.message}".lower()
    return all(w in hay for w in words)


def figure(alert: Alert) -> str:
    """``0.62 ≥ 0.5``: the value against its threshold, when the alert carries them."""
    if alert.value is None:
        return ""
    value = f"{alert.value:.3g}" if isinstance(alert.value, float) else str(alert.value)
    if alert.threshold is None:
        return value
    thr = (f"{alert.threshold:.3g}" if isinstance(alert.threshold, float)
           else str(alert.threshold))
    return f"{value} / {thr}"


def active_now(state: ConsoleState) -> list[tuple[str, str, str]]:
    """(engine, name, level) of every alert active now (`ConsoleState.alerts_active`: each
    engine's heartbeat, which a console attached late also has, brought up to date by the
    level changes heard since)."""
    out: dict[tuple[str, str], str] = {}
    for eng in state.engines.values():
        where = f"{eng.engine}/{eng.rank}" if len(state.engines) > 1 else eng.engine
        for name, level in state.alerts_active(eng).items():
            out[(where, name)] = level
    rank = {"critical": 0, "warning": 1}
    return sorted(((w, n, lvl) for (w, n), lvl in out.items()),
                  key=lambda t: (rank.get(t[2], 2), t[0], t[1]))


class AlertsScreen(FilteredScreen):
    MODE = "alerts"
    TABLE = "alert-table"
    COLUMNS = [("when", "when"), ("level", "level"), ("alert", "name"), ("engine", "engine"),
               ("value", "value"), ("message", "message")]
    BINDINGS = ALERTS

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[Alert] = []
        self._signature: tuple[Any, ...] | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="alert-summary")
        yield row_table("alert-table")
        yield Input(placeholder="filter alerts (enter keeps, esc clears)", id="alert-filter",
                    classes="filter-input")
        yield Static(id="alert-detail")

    def selected(self) -> Alert | None:
        row = self.table.cursor_row
        return self.shown[row] if 0 <= row < len(self.shown) else None

    # --- data ------------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        alerts = state.alerts
        last = alerts[-1].recv_ts if alerts else None
        # Ages move once a second; the table is rebuilt no more often than that.
        sig = (len(alerts), last, self.filter_text, int(frame.now), len(state.engines))
        if sig != self._signature:
            self._signature = sig
            self._rebuild(state, frame.now)
        self._show_summary(state)
        self._show_detail(frame.now)

    def _rebuild(self, state: ConsoleState, now: float) -> None:
        table = self.table
        # At the top the cursor follows the newest alert; moved down, it stays on its alert.
        keep = self.selected() if table.cursor_row > 0 else None
        words = self.filter_text.lower().split()
        several = len(state.engines) > 1
        self.shown = [a for a in reversed(state.alerts) if matches(a, words)]
        table.clear()
        for i, a in enumerate(self.shown):
            where = f"{a.engine}/{a.rank}" if several else a.engine
            table.add_row(fmt.duration(max(0.0, now - a.recv_ts)) + " ago",
                          Text(printable(a.level), style=LEVEL_STYLE.get(a.level, "")),
                          printable(a.name),
                          fmt.clip(where, 16), figure(a), fmt.clip(a.message, 60), key=str(i))
        if keep is not None and keep in self.shown:
            table.move_cursor(row=self.shown.index(keep), animate=False)

    def _show_summary(self, state: ConsoleState) -> None:
        active = active_now(state)
        if active:
            parts = [f"[{LEVEL_MARKUP.get(lvl, '')}]● {fmt.escape(name)} {lvl}[/]"
                     + (f" [$text-muted]{fmt.escape(where)}[/]" if len(state.engines) > 1
                        else "")
                     for where, name, lvl in active]
            text = f"[b]{len(active)}[/] active  " + "  ".join(parts)
        else:
            text = "[$success]nothing active[/]"
        n = len(state.alerts)
        text += (f"\n[$text-muted]{n} event{'s' if n != 1 else ''} heard (the last "
                 f"{ALERT_HISTORY} kept), newest first[/]")
        if self.filter_text:
            text += (f" · filter [b]{fmt.escape(self.filter_text)}[/]: {len(self.shown)} "
                     f"shown · esc clears")
        elif not n:
            text += " · [$text-muted]an alert fires when a figure crosses its threshold[/]"
        self.query_one("#alert-summary", Static).update(Content.from_markup(text))

    def _show_detail(self, now: float) -> None:
        box = self.query_one("#alert-detail", Static)
        a = self.selected()
        if a is None:
            box.update("")
            return
        fig = figure(a)
        head = (f"[{LEVEL_MARKUP.get(a.level, '')} b]{fmt.escape(a.name)} {a.level}[/]  "
                f"[$text-muted]{fmt.escape(a.engine)} rank {a.rank} · "
                f"{fmt.duration(max(0.0, now - a.recv_ts))} ago"
                + (f" · value / threshold {fmt.escape(fig)}" if fig else "") + "[/]")
        text = f"{head}\n{fmt.escape(a.message)}"
        path = stacks_path(a.message)
        if path is not None:
            frames = busy_loop_frames(path)
            text += ("\n[b]busy loop:[/] " + " ← ".join(fmt.escape(f) for f in frames)
                     if frames else f"\n[$text-muted]stacks file not readable here: "
                     f"{fmt.escape(path)}[/]")
        box.update(Content.from_markup(text))

    @on(DataTable.RowHighlighted, "#alert-table")
    def _highlighted(self) -> None:
        self._show_detail(self.console.state.clock())
