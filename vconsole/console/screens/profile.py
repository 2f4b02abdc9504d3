"""Profile: run `torch.profiler` over the engine's next N steps and show where the time went.

``s`` starts a profile after a confirmation (profiling slows every step until it is done, and
the box says so); the run itself (`vconsole.console.profile_run.follow`) is an app worker, so it
goes on while the operator looks elsewhere, and this screen draws ``app.steering.profile_run``: progress
while it runs, then the step phase shares, the time per layer type and the top operators by
self time, scrollable at 80x24. Read-only hides the actions (and the ``P`` key that leads here).
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static
from textual.worker import get_current_worker

from vconsole.console import format as fmt
from vconsole.console.keymap import PROFILE
from vconsole.console.profile_run import (
    DEFAULT_STEPS,
    STEP_CHOICES,
    ProfileRun,
    follow,
    supports_profile,
)
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.telemetry.control import NotAuthorised

if TYPE_CHECKING:
    from vconsole.console.app import VConsoleApp

IDLE_HINT_S = 3.0    # no profiled step for this long: say why
STATE_STYLE = {"done": "$success", "running": "$warning", "starting": "$warning",
               "cancelled": "$text-muted", "failed": "$error", "error": "$error"}


def consequence(steps: int) -> str:
    return (f"torch.profiler records every operator of the engine's next {steps} steps and "
            "every layer is labelled while it runs: those steps run slower, and building the "
            "report afterwards slows the engine a little longer. Requests keep being served "
            "and their tokens do not change. c cancels.")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def result_lines(result: dict[str, Any], width: int) -> list[str]:
    """The tables of a finished profile, as markup lines at most ``width`` cells wide."""
    phases = result["phases"]
    lines = ["[b]Step phases[/] [$text-muted](the engine's step timings, same steps)[/]",
             "  " + "   ".join(f"{p} [b]{fmt.pct(s)}[/]" for p, s in phases.items()), ""]
    layers = result["layers"]
    total = sum(layers.values()) or 1.0
    bar_w = max(0, min(24, width - 36))
    lines.append(f"[b]Time by layer type[/] [$text-muted]({result['layers_clock'].upper()} "
                 "time, inclusive)[/]")
    for kind, seconds in layers.items():
        share = seconds / total
        lines.append(f"  {fmt.escape(fmt.clip(kind, 10)):<10} {_ms(seconds):>12} "
                     f"{fmt.pct(share):>6} [$accent]{fmt.bar(share, bar_w)}[/]")
    clock = "CUDA" if result["sort_by"] == "self_cuda_s" else "CPU"
    cuda = result["device"] == "cuda"
    name_w = max(12, width - (2 + 13 + (13 if cuda else 0) + 9))
    ops = result["ops"]
    lines += ["", f"[b]Top {len(ops)} operators[/] [$text-muted](by self {clock} time)[/]",
              f"[$text-muted]  {'operator':<{name_w}} {'self CPU':>12}"
              + (f" {'self CUDA':>12}" if cuda else "") + f" {'calls':>8}[/]"]
    for op in ops:
        name = fmt.escape(fmt.clip(op["name"], name_w))
        pad = " " * (name_w - min(len(op["name"]), name_w))
        lines.append(f"  {name}{pad} {_ms(op['self_cpu_s']):>12}"
                     + (f" {_ms(op['self_cuda_s']):>12}" if cuda else "")
                     + f" {op['calls']:>8,}")
    return lines


class ProfileScreen(ConsoleScreen):
    MODE = "profile"
    BINDINGS = PROFILE

    def __init__(self) -> None:
        super().__init__()
        self.steps = DEFAULT_STEPS
        self._shown: tuple[Any, ...] = ()

    @property
    def run(self) -> ProfileRun | None:
        return self.console.steering.profile_run

    def compose_body(self) -> ComposeResult:
        yield Static(id="prof-summary")
        with VerticalScroll(id="prof-results"):
            yield Static(id="prof-text")

    def on_mount(self) -> None:
        self.query_one("#prof-results").focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action not in ("start", "cancel", "steps"):
            return True
        app = self.console
        if app.readonly or not supports_profile(app.steering.control):
            return False
        running = self.run is not None and self.run.active
        if action == "cancel":
            return True if running and self.run is not None and self.run.id else None
        return None if running else True

    # --- drawing --------------------------------------------------------------------------

    def apply(self, frame: Frame, state: ConsoleState) -> None:
        run = self.run
        width = max(40, self.query_one("#prof-text").content_size.width
                    or self.query_one("#prof-results").content_size.width - 3)
        idle = (run is not None and run.active and run.steps_done == 0
                and time.monotonic() - run.moved > IDLE_HINT_S)
        key = (run.generation if run else None, id(run), width, self.steps, frame.readonly,
               idle)
        if key == self._shown:
            return
        self._shown = key
        self.query_one("#prof-summary", Static).update(
            Content.from_markup(self._summary(run, frame, idle, width)))
        text = result_lines(run.result, width) if run and run.result else []
        self.query_one("#prof-text", Static).update(Content.from_markup("\n".join(text)))
        self.refresh_bindings()

    def _summary(self, run: ProfileRun | None, frame: Frame, idle: bool, width: int) -> str:
        if frame.readonly:
            ro = (f"[$warning]read-only ({fmt.escape(frame.readonly_reason)}): profiling is "
                  "disabled[/]")
            return ro if run is None else ro + "\n" + self._run_line(run)
        hint = f"s profiles the next [b]{self.steps}[/] steps (+/- to change; it asks first)"
        if run is None:
            return hint + ("\n[$text-muted]No profile yet. Profiling slows the engine until it "
                           "is done, and it advances only while the engine serves requests.[/]")
        lines = [self._run_line(run)]
        if run.active:
            lines.append("[$warning]the engine runs slower while profiling[/]"
                         + (" · c cancels" if run.id else ""))
            if idle:
                lines.append("[$text-muted]waiting for steps: the engine profiles only while "
                             "it serves requests[/]")
        else:
            if run.result:
                note = fmt.clip(run.result["slowdown_note"], width)
                lines.append(f"[$text-muted]{fmt.escape(note)}[/]")
            lines.append(hint)
        return "\n".join(lines)

    def _run_line(self, run: ProfileRun) -> str:
        name = f"profile {run.id}" if run.id else "profile"
        style = STATE_STYLE.get(run.state, "")
        head = f"[b]{fmt.escape(name)}[/] [{style}]{fmt.escape(run.state)}[/]"
        if run.active:
            return (f"{head}  {run.steps_done}/{run.steps} steps "
                    f"[$accent]{fmt.bar(run.steps_done / run.steps, 20)}[/]")
        r = run.result
        if r is not None:
            return (f"{head}  {r['steps']} steps ({r['first_step'] + 1}–{r['last_step']}) on "
                    f"{fmt.escape(r['device'])} · {r['wall_s']:.2f} s wall · mean step "
                    f"{_ms(r['mean_step_s'])}")
        why = f": {fmt.escape(run.error)}" if run.error else ""
        return f"{head} after {run.steps_done}/{run.steps} steps{why}"

    # --- actions --------------------------------------------------------------------------

    def action_steps(self, step: int) -> None:
        i = min(range(len(STEP_CHOICES)), key=lambda j: abs(STEP_CHOICES[j] - self.steps))
        self.steps = STEP_CHOICES[max(0, min(len(STEP_CHOICES) - 1, i + step))]
        self.console.refresh_view(force=True)

    def action_start(self) -> None:
        app = self.console
        if app.readonly or not supports_profile(app.steering.control):
            return
        if self.run is not None and self.run.active:
            self.notify(f"{self.run.id or 'a profile'} is running: c cancels it",
                        title="Profile", severity="warning")
            return
        steps = self.steps

        def done(ok: bool | None) -> None:
            if ok:
                start_profile(app, steps)
            else:
                self.notify("no profile started", title="Profile")
        app.push_screen(ConfirmScreen(f"Profile the engine's next {steps} steps?",
                                      consequence(steps), "Start profile"), done)

    def action_cancel(self) -> None:
        app, run = self.console, self.run
        if app.readonly or run is None or not run.active or run.id is None:
            return
        app.run_worker(partial(_cancel, app, run.id), thread=True, group="profile-cancel")


def start_profile(app: VConsoleApp, steps: int) -> ProfileRun:
    """Start following a new profile of ``steps`` steps (the operator confirmed)."""
    run = ProfileRun(steps)
    app.steering.profile_run = run
    app.run_worker(partial(_follow, app, run), thread=True, group="profile", exclusive=True)
    app.refresh_view(force=True)
    return run


def _follow(app: VConsoleApp, run: ProfileRun) -> None:
    worker = get_current_worker()

    def changed() -> None:
        if not worker.is_cancelled:
            app.call_from_thread(app.refresh_view, True)
    try:
        follow(app.steering.control, run, worker.cancelled_event, changed)
    except NotAuthorised:
        app.call_from_thread(app.key_refused)


def _cancel(app: VConsoleApp, profile_id: str) -> None:
    try:
        app.steering.control.profile_cancel(profile_id)  # type: ignore[union-attr]
    except Exception as e:
        app.call_from_thread(app.notify, f"cancelling {profile_id} failed: {e}",
                             title="Profile", severity="error")
