"""``?``: every key, grouped by screen, plus what the colours and glyphs mean."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import DP_HELP, FLEET_HELP, HELP_SECTIONS, LONE_ENGINE_HELP

LEGEND = [
    ("[$success]●[/] [$warning]●[/] [$error]●[/]", "ok / warning / critical (engine's alert "
                                                     "thresholds; memory warns at 80 %)"),
    ("hb", "heartbeat age; the engine is down after 3 missed heartbeats"),
    ("[$success]█[/] [$primary]█[/] [$accent]█[/] [$text-muted]·[/]",
     "KV block used / cached (free, reusable prefix) / shared / free"),
    ("░ ▒ ▓ █", "KV cell holding several blocks: share of them not free"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, readonly: bool = False, dp: bool = False, fleet: bool = False) -> None:
        super().__init__()
        self.fleet = fleet  # several targets: the Fleet screen's keys are listed too
        self.readonly = readonly
        self.dp = dp    # a data-parallel group is watched: its keys are listed too

    def compose(self) -> ComposeResult:
        # At 80x24 most of it is below the fold: the first line says how to get there.
        lines = ["[b]vconsole[/] — keys  [$text-muted]↑ ↓ pgup pgdn scroll · esc or ? "
                 "closes[/]"]
        sections = [*([FLEET_HELP] if self.fleet else []), *HELP_SECTIONS,
                    DP_HELP if self.dp else LONE_ENGINE_HELP]
        for title, keys in sections:
            if self.readonly and title == "Config":
                keys = [("", "read-only: config changes are disabled")]
            if self.readonly and title == "Profile":
                keys = [("", "read-only: profiling is disabled")]
            if self.readonly and title == "What-if":
                keys = [k for k in keys if k[0] != "A"] + [("", "read-only: predicts, never "
                                                                "applies")]
            if self.readonly and title == "Advice":
                keys = [("a", "tuning advice (read-only: shown, never applied)")]
            lines.append(f"\n[b $accent]{title}[/]")
            lines += [f"  [b]{fmt.escape(k):<14}[/] {fmt.escape(v)}" for k, v in keys]
        lines.append("\n[b $accent]Legend[/]")
        for glyph, text in LEGEND:
            pad = " " * max(1, 15 - Content.from_markup(glyph).cell_length)
            lines.append(f"  {glyph}{pad}{fmt.escape(text)}")
        lines.append("\n[$text-muted]esc or ? closes[/]")
        with VerticalScroll(id="help-box"):
            yield Static(Content.from_markup("\n".join(lines)), id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
