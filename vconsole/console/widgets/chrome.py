"""The frame every screen shares: the tab bar, the problem banner, the "too small" notice.

They render from a `Frame` the app builds once per refresh, so all screens agree on what the
engine's status is and none of them computes it separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.engine_state import STALE_INTERVALS, EngineState
from vconsole.console.keymap import (
    DP_SCREEN,
    FLEET_SCREEN,
    LETTER_SCREENS,
    SCREENS,
    TOOL_SCREENS,
)
from vconsole.console.state import ConsoleState
from vconsole.engine.kernel_cache import COMPILING, EXPECTED_BUILD, build_in_progress

if TYPE_CHECKING:
    from vconsole.console.sources.source import Source


@dataclass
class Frame:
    """What the chrome needs to know, computed once per refresh by the app."""

    now: float
    mode: str
    engine: EngineState | None
    engine_index: int = 0
    engine_count: int = 0
    source: str = ""
    live: bool = True
    paused: bool = False
    readonly: bool = False
    readonly_reason: str = ""
    recording: str | None = None
    recorded: int = 0
    schema_error: str | None = None
    last_error: str | None = None
    endpoints: str = ""
    address: str = ""         # where the engine is, when the app was told (the demo's base)
    dp_size: int = 0          # ranks in the watched data-parallel group; 0 for a lone engine
    fleet: bool = False       # several targets are watched: the Fleet tab is shown
    fleet_status: str = ""    # on the Fleet screen, the right of the tab bar: "3/4 up"

    @property
    def status(self) -> str:
        return "connecting" if self.engine is None else self.engine.status(self.now)

    @classmethod
    def build(cls, st: ConsoleState, mode: str, selected: str | None, source: Source, *,
              paused: bool, readonly_reason: str, endpoints: str, address: str = "",
              fleet: bool = False, fleet_status: str = "") -> Frame:
        """The frame of one refresh (under the state's lock): the ``selected`` engine (a key;
        None: the first) as ``source`` (the one that feeds it) says."""
        now = st.now()
        engines = st.engine_list()
        eng = st.engine(selected)
        ranks = st.dp_ranks(eng)
        return cls(
            now=now, mode=mode, engine=eng,
            engine_index=engines.index(eng) if eng in engines else 0,
            engine_count=len(engines), source=source.describe(),
            live=source.live, paused=paused,
            readonly=bool(readonly_reason), readonly_reason=readonly_reason,
            recording=source.recording_path if source.recording else None,
            recorded=source.recorded, schema_error=st.schema_problem(now),
            last_error=st.recent_error(now) or (
                f"telemetry reader stopped: {source.error}" if source.error else None),
            endpoints=endpoints, address=address,
            dp_size=st.dp_world_size(ranks) if ranks else 0, fleet=fleet,
            fleet_status=fleet_status)


STATUS_STYLE = {"running": "$success", "idle": "$accent", "draining": "$warning",
                "down": "$error", "connecting": "$warning", "restarting": "$error"}


class TabBar(Static):
    """``vconsole  1 Overview 2 Requests …`` on the left; flags, the engine's name and address
    and its status on the right. Where the width runs out, tab titles shrink to keys first,
    then the name goes (the Overview's summary line names it too), then the address."""

    def show(self, frame: Frame) -> None:
        width = self.content_size.width or 80
        brand = "[b $accent]vconsole[/] "
        dp = frame.dp_size > 1
        fl = frame.fleet
        lefts = [brand + self._tabs(frame.mode, full=True, dp=dp, fleet=fl),
                 self._tabs(frame.mode, full=True, dp=dp, fleet=fl),
                 self._tabs(frame.mode, full=False, dp=dp, fleet=fl)]
        flags = []
        if not frame.live and frame.source:    # a replay: where it is, and when it has ended
            flags.append(f"[$accent b]{fmt.escape(frame.source)}[/]")
        if frame.recording:
            flags.append("[$error b]● REC[/]")
        if frame.paused:
            flags.append("[$warning b]PAUSED[/]")
        if frame.readonly and frame.live:      # (a replay is read-only by nature)
            flags.append("[$text-muted]read-only[/]")
        eng = frame.engine
        name: list[str] = []
        if frame.fleet_status and frame.mode == "fleet":   # the fleet's, not one engine's
            status = [frame.fleet_status]
        elif eng is None:
            status = [f"[{STATUS_STYLE['connecting']}]● waiting for telemetry[/]"]
        else:
            label = fmt.escape(eng.label)
            if dp:
                label = f"{fmt.escape(eng.engine)} rank {eng.rank}/{frame.dp_size}"
            elif frame.engine_count > 1:
                label += f" ({frame.engine_index + 1}/{frame.engine_count})"
            name = [label]
            hb = eng.heartbeat_age(frame.now)
            hb_style = "$error b" if eng.is_stale(frame.now) else (
                "$warning" if hb is not None and hb > 1.5 * eng.heartbeat_interval else "")
            hb_text = "hb " + (fmt.duration(hb) if hb is not None else "–")
            status = [f"[{STATUS_STYLE.get(frame.status, '')}]● {frame.status}[/]",
                      f"[{hb_style}]{hb_text}[/]" if hb_style else hb_text]
        where = [f"[$text-muted]{fmt.escape(frame.address)}[/]"] if frame.address else []
        rights = [" ".join(flags + name + where + status), " ".join(flags + where + status),
                  " ".join(flags + status), " ".join(flags[:2] + status)]
        # The engine's name and status outrank tab titles: tabs shrink to keys first.
        for right in rights:
            for left in lefts:
                left_c, right_c = Content.from_markup(left), Content.from_markup(right)
                if left_c.cell_length + right_c.cell_length + 1 <= width:
                    break
            else:
                continue
            break
        gap = max(1, width - left_c.cell_length - right_c.cell_length)
        self.update(left_c + Content(" " * gap) + right_c)

    @staticmethod
    def _tabs(current: str, *, full: bool, dp: bool = False, fleet: bool = False) -> str:
        tabs = []
        screens = {**SCREENS, **DP_SCREEN} if dp or current in DP_SCREEN else SCREENS
        if fleet:
            screens = {**FLEET_SCREEN, **screens}
        # Every screen has its tab, the lettered ones too: a screen nobody sees is never found.
        tools = {m: v for m, v in TOOL_SCREENS.items() if m == current}   # only while shown
        for mode, (key, title) in {**screens, **LETTER_SCREENS, **tools}.items():
            text = f"{key} {title}" if full else (f"{key} {title}" if mode == current else key)
            tabs.append(f"[reverse b] {text} [/]" if mode == current
                        else f"[$text-muted] {text} [/]")
        return "".join(tabs)


class Banner(Static):
    """A one-line alarm shown only when something is wrong with the link itself: engine down,
    schema mismatch, reader errors. Hidden otherwise, so a healthy console has no clutter."""

    def show(self, frame: Frame) -> None:
        text, level = self.message(frame)
        self.set_class(bool(text), "-shown")
        self.set_class(level == "error", "-error")
        self.set_class(level == "warning", "-warning")
        if text:
            self.update(Content(text))

    @staticmethod
    def message(frame: Frame) -> tuple[str, str]:
        if frame.schema_error:
            return (f"SCHEMA MISMATCH — {frame.schema_error}. Use a console and an engine from "
                    f"the same vconsole version.", "error")
        # The Fleet screen's rows say each engine's state: no banner for the one selected.
        eng = frame.engine if frame.mode != "fleet" else None
        if eng is not None and eng.is_stale(frame.now):
            age = eng.heartbeat_age(frame.now)
            since = fmt.duration(age) if age is not None else "start"
            again = ("reconnecting automatically" if frame.live
                     else "the recording has a gap here")
            return (f"ENGINE DOWN — no heartbeat for {since} (> {STALE_INTERVALS:g} × "
                    f"{eng.heartbeat_interval:g}s); {again}.", "error")
        if eng is None and frame.live and frame.mode != "fleet":
            where = frame.endpoints or "the engine"
            if build_in_progress() is not None:     # a local engine's first start
                return (f"Waiting for telemetry from {where} … the engine is {COMPILING}, "
                        f"{EXPECTED_BUILD}.", "warning")
            return f"Waiting for telemetry from {where} … (is the engine running?)", "warning"
        if frame.last_error:
            return frame.last_error, "warning"
        return "", ""


class TooSmall(Static):
    """Shown instead of the screen's body below the minimum size (btop's habit)."""

    def show_size(self, width: int, height: int, need_w: int, need_h: int) -> None:
        self.update(Content.from_markup(
            f"[b]terminal too small[/]\n\nneed {need_w}×{need_h}, have {width}×{height}\n\n"
            f"[$text-muted]enlarge the window, or press q to quit[/]"))
