"""Advice: what the tuning advisor (`vconsole.console.advisor`) makes of the recent telemetry.

One row per suggestion (the rule, the change and, under it, its predicted effect; hot or
restart-only); below it the selected one's reasons, figures and whole prediction, then what
became of the suggestions applied from here.

Predictions (`vconsole.console.predictions`, the host's `predict_later`): each suggestion's
``change`` simulated on the engine's last minutes of traffic, in a thread worker, when the
screen is shown and when a suggestion appears or changes its values (at most every
`REPREDICT_S`) — never per telemetry tick. Too little traffic, a key no simulation models or no
control channel say so instead of a figure; so does advice for an engine the control channel
does not steer (its trace is another engine's).

``A`` (or enter) applies a hot suggestion through the host (``steer`` of Steering's plan: the
confirmation, then one ``set_config``); restart-only ones are shown with
the command that would apply them, never sent. While the confirmation box is open the list
behind it is held (the advisor may have moved on: the box and the row must say the same, and
what is sent is what the box shows); it catches up when the box closes. Read-only hides the
action. The advice is the same for a live engine and a replayed recording.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import DataTable, Static

from vconsole.console import format as fmt
from vconsole.console.advice_window import WINDOW_S
from vconsole.console.advisor import Advice
from vconsole.console.keymap import ADVICE
from vconsole.console.predictions import (
    NOT_PREDICTED,
    PENDING,
    SHOWN,
    Prediction,
    pending,
)
from vconsole.console.screens.base import ConsoleScreen, row_table
from vconsole.console.sources.fleet.imbalance import REMEDY
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.confirmation import ConfirmScreen

REPREDICT_S = 3.0     # a suggestion whose values move is predicted again at most this often
OTHER_ENGINE = ("the what-if reads the trace of the engine the control channel steers; this "
                "advice is for another")
PredKey = tuple[str, str]


def pred_key(advice: Advice) -> PredKey:
    return advice.id, repr(sorted(advice.change.items()))


RULES_WATCHED = ("scheduler share, KV fragmentation, KV pressure, TTFT, queue waiting for seats, "
                 "step time")


def evidence_text(evidence: dict[str, Any]) -> str:
    """``sched_share 0.214 · threshold 0.15 · held in 25 of 26 snapshots (10 s)``."""
    parts = []
    for key, value in evidence.items():
        if key in ("held_in", "snapshots", "window_s"):
            continue
        shown = f"{value:.3g}" if isinstance(value, float) else \
            "–" if value is None else fmt.escape(str(value))
        parts.append(f"{key} {shown}")
    if "held_in" in evidence:
        parts.append(f"held in {evidence['held_in']} of {evidence.get('snapshots', '?')} "
                     f"snapshots ({evidence.get('window_s', WINDOW_S):g} s)")
    return " · ".join(parts)


def why_not_applied(advice: Advice) -> str:
    """Why a restart-only suggestion is shown but never sent from the console."""
    return (f"restart-only: the engine fixes {', '.join(advice.change)} at start and would "
            f"answer 'restart required' without changing anything. Restart it with: "
            f"{advice.restart_command()}")


class AdviceScreen(ConsoleScreen):
    MODE = "advice"
    TABLE = "adv-table"
    # "suggests" last: its second line (the prediction) may run past 80 columns, the rest not.
    COLUMNS = [("rule", "rule"), ("applies", "mode"), ("suggests", "change")]
    BINDINGS = ADVICE

    def __init__(self) -> None:
        super().__init__()
        self.advice: list[Advice] = []
        self._ids: list[str] = []
        self.predictions: dict[PredKey, Prediction] = {}
        self._predicting = False
        self._asked_at = -1e18
        self._steered = True        # the advice is for the engine the control channel steers

    def compose_body(self) -> ComposeResult:
        yield Static(id="adv-summary")
        yield row_table("adv-table")
        yield Static(id="adv-detail")
        yield Static(id="adv-history")
        yield Static(id="adv-fleet")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action != "apply":
            return True
        if self.console.readonly:
            return False
        sel = self.selected()
        return True if sel is not None and sel.hot else None

    def selected(self) -> Advice | None:
        row = self.table.cursor_row
        return self.advice[row] if 0 <= row < len(self.advice) else None

    # --- data ------------------------------------------------------------------------------

    def confirming(self) -> bool:
        """A confirmation box stands in front of this screen (the one ``A`` opened)."""
        stack = self.app.screen_stack
        return stack[-1] is not self and isinstance(stack[-1], ConfirmScreen) and self in stack

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        if self.confirming():
            # The box names one suggestion's change and confirming sends exactly that: the
            # list behind it holds still until the box closes (then it catches up at once,
            # `on_screen_resume`), so the box and the row it came from never disagree.
            return
        self.advice = state.advice(frame.engine)
        self._steered = frame.engine is None or frame.engine is state.engine()
        ids = [a.id for a in self.advice]
        if ids != self._ids:
            self._rebuild(ids)
        else:  # same suggestions, maybe new figures: refresh the cells in place
            for a in self.advice:
                self.table.update_cell(a.id, "change", self._suggests(a))
        self._want_predictions()
        self._show_summary(frame)
        self._show_detail()
        self._show_history()
        self._show_fleet(state)

    def _rebuild(self, ids: list[str]) -> None:
        table = self.table
        keep = self._ids[table.cursor_row] if 0 <= table.cursor_row < len(self._ids) else None
        table.clear()
        for a in self.advice:
            mode = Text("hot", style="green") if a.hot else Text("restart", style="yellow")
            table.add_row(a.title, mode, self._suggests(a), key=a.id, height=2)
        self._ids = ids
        if keep in ids:
            table.move_cursor(row=ids.index(keep), animate=False)
        self.refresh_bindings()

    # --- predictions ----------------------------------------------------------------------

    def prediction(self, advice: Advice) -> Prediction | None:
        if not self._steered:
            return Prediction(NOT_PREDICTED, dict(advice.change), OTHER_ENGINE)
        return self.predictions.get(pred_key(advice))

    def _suggests(self, a: Advice) -> Text:
        """The change, and under it its predicted effect (dim while there is no figure)."""
        p = self.prediction(a)
        text = Text(fmt.clip(a.change_text(), 48))
        if p is not None:
            text.append("\n")
            text.append(fmt.clip(p.short(), 48), style="" if p.ready else "dim")
        return text

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self._want_predictions(again=True)

    def _want_predictions(self, again: bool = False) -> None:
        """Ask for the suggestions not yet predicted (``again``: all of them, the screen was
        just shown), one worker at a time, at most every `REPREDICT_S` unless shown anew."""
        if not self.advice or self._predicting or not self._steered:
            return
        todo = {pred_key(a): a for a in self.advice
                if again or pred_key(a) not in self.predictions}
        now = time.monotonic()
        if not todo or (not again and now - self._asked_at < REPREDICT_S):
            return
        self._predicting, self._asked_at = True, now
        for k, a in todo.items():
            self.predictions.setdefault(k, pending(a.change))
        self.console.predict_later(self, [a.change for a in todo.values()],
                                   partial(self._predicted, list(todo)))

    def _predicted(self, keys: list[PredKey], predictions: list[Prediction]) -> None:
        self._predicting = False
        self.predictions.update(zip(keys, predictions, strict=True))
        live = {pred_key(a) for a in self.advice}
        for k in [k for k in self.predictions if k not in live]:
            del self.predictions[k]         # suggestions gone: forget their predictions
        for a in self.advice:
            if a.id in self._ids:
                self.table.update_cell(a.id, "change", self._suggests(a), update_width=True)
        self._show_detail()
        self._want_predictions()

    def _show_summary(self, frame: Frame) -> None:
        n = len(self.advice)
        if frame.engine is None:
            text = "[$text-muted]no telemetry yet[/]"
        elif not n and frame.engine.advisor.evidence_s() < frame.engine.advisor.min_span_s:
            adv = frame.engine.advisor
            text = (f"[$text-muted]no advice yet: gathering evidence ({adv.evidence_s():.0f} of "
                    f"{adv.min_span_s:g} s since attaching or the last config change)[/]")
        elif not n:
            text = (f"[$text-muted]no advice: nothing in the last {WINDOW_S:g} s of telemetry "
                    f"calls for a change (watching {RULES_WATCHED})[/]")
        else:
            hot = sum(a.hot for a in self.advice)
            text = (f"[b]{n}[/] suggestion{'s' if n != 1 else ''} from the last {WINDOW_S:g} s "
                    f"· {hot} hot")
            if frame.readonly:
                text += f" · [$warning]read-only: {fmt.escape(frame.readonly_reason)}[/]"
            elif hot:
                text += " · A applies the selected hot one (asks first)"
        self.query_one("#adv-summary", Static).update(Content.from_markup(text))

    def _show_detail(self) -> None:
        box = self.query_one("#adv-detail", Static)
        a = self.selected()
        if a is None:
            box.update("")
            return
        if a.hot:
            how = ("[$success]hot[/]: applied between two steps"
                   + ("" if self.console.readonly else " · A applies (asks first)"))
        else:
            how = ("[$warning]restart-only[/]: shown, not sent (the engine would answer "
                   "'restart required')")
        box.update(Content.from_markup(
            f"[b]{fmt.escape(a.change_text())}[/]  {how}{self._prediction_text(a)}\n"
            f"{fmt.escape(a.message)}\n[$text-muted]{evidence_text(a.evidence)}[/]"))

    def _prediction_text(self, a: Advice) -> str:
        p = self.prediction(a)
        if p is None:
            return ""
        if not p.ready:
            style = "$text-muted" if p.status == PENDING else "$warning"
            return f"\n[{style}]{fmt.escape(p.headline())}[/]"
        source = f" from the engine's last {p.trace.describe()}" if p.trace else ""
        return (f"\n[b]predicted[/]: {fmt.escape(p.short(SHOWN))} "
                f"[$text-muted](simulated{fmt.escape(source)})[/]")

    def _show_history(self) -> None:
        box = self.query_one("#adv-history", Static)
        done = self.console.steering.advice_outcomes
        if not done:
            box.update("")
            return
        lines = ["[b]applied from here[/]"]
        for out in reversed(done[-4:]):
            style = "$success" if out.ok else "$error"
            lines.append(f"{fmt.escape(out.advice.change_text())}  "
                         f"[{style}]{fmt.escape(out.summary)}[/]")
        box.update(Content.from_markup("\n".join(lines)))

    def _show_fleet(self, state: ConsoleState) -> None:
        """A fleet's imbalance findings (`sources.fleet.imbalance`): no config change fixes a
        router or a dead replica, so each says what to look at, with its evidence."""
        box = self.query_one("#adv-fleet", Static)
        found = state.fleet_findings
        box.display = bool(found)
        if not found:
            return
        lines = [f"[b]fleet[/] · {len(found)} finding{'s' if len(found) != 1 else ''} "
                 "[$text-muted](the router or the replicas, not one engine's config)[/]"]
        for f in found[:4]:
            style = "$error" if f["level"] == "critical" else "$warning"
            lines.append(f"[{style}]{fmt.escape(f['message'])}[/]")
            lines.append(f"  {fmt.escape(REMEDY.get(f['rule'], ''))} "
                         f"[$text-muted]{evidence_text(f['evidence'])}[/]")
        box.update(Content.from_markup("\n".join(lines)))

    @on(DataTable.RowHighlighted, "#adv-table")
    def _highlighted(self) -> None:
        self._show_detail()
        self.refresh_bindings()

    # --- applying --------------------------------------------------------------------------

    @on(DataTable.RowSelected, "#adv-table")
    def _selected(self) -> None:
        self.action_apply()

    def action_apply(self) -> None:
        a = self.selected()
        if a is None or self.console.readonly:
            return
        if not a.hot:
            self.notify(why_not_applied(a), title="Advice", severity="warning")
            return
        host = self.console
        reason = host.steer(host.steering.plan_advice(a, host.current_engine()))
        if reason is not None:
            self.notify(reason, title="Advice", severity="warning")
