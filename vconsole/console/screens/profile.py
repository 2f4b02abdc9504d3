"""Profile: run `torch.profiler` over the engine's next N steps and show where the time went.

``s`` starts a profile after a confirmation (profiling slows every step until it is done, and
the box says so) and ``c`` cancels it: both go through `vconsole.console.steering.Steering`,
which follows the run in a worker, so it goes on while the operator looks elsewhere. This screen
only draws ``app.steering.profile_run``: progress while it runs, then the step phase shares, the
time per layer type and the top operators by self time, scrollable at 80x24. Read-only hides the
actions (and the ``P`` key that leads here).
"""

from __future__ import annotations

import time
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.keymap import PROFILE
from vconsole.console.profile_run import DEFAULT_STEPS, STEP_CHOICES, ProfileRun
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.state import ConsoleState
from vconsole.console.widgets.chrome import Frame

IDLE_HINT_S = 3.0    # no profiled step for this long: say why
STATE_STYLE = {"done": "$success", "running": "$warning", "starting": "$warning",
               "cancelled": "$text-muted", "failed": "$error", "error": "$error"}


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
        if not self.console.steering.can_profile:
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
        """Ask Steering to profile the next ``steps`` steps (it asks the operator first)."""
        host = self.console
        if not host.steering.can_profile:
            return
        reason = host.steer(host.steering.plan_profile(self.steps))
        if reason is not None:      # one at a time
            self.notify(reason, title="Profile", severity="warning")

    def action_cancel(self) -> None:
        self.console.steering.cancel_profile()
