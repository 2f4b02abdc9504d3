"""The confirmation box's forecast: a config change's predicted effect, as lines to show.

`forecast` says what the box of a change shows (`vconsole.console.predictions`): why there is
no prediction (a key no simulation models), a prediction the trace in hand already answered,
or "predicting…" at once and the prediction when the work is done. The box runs ``work`` in a
thread worker while the operator reads (`vconsole.console.widgets.confirmation.ConfirmScreen`);
nothing waits on it. Plain data and markup strings: no Textual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vconsole.console import format as fmt
from vconsole.console.predictions import (
    MARK,
    NOT_PREDICTED,
    PENDING,
    SHOWN,
    UNAVAILABLE,
    Change,
    Prediction,
    WhatIf,
    change_pct,
    change_style,
    figure,
    pending,
    unmodelled,
)
from vconsole.whatif.overload import GROWS, wait_mark
from vconsole.whatif.predict import LABELS, tolerance


@dataclass(frozen=True)
class Forecast:
    """Lines for the box: ``first`` (Content markup) at once, replaced by what ``work``
    returns (blocking; markup) when there is work."""

    first: str
    work: Callable[[], str] | None = None


def forecast(whatif: WhatIf, change: Change) -> Forecast | None:
    """The box's lines for ``change``: its predicted effect (computed while the operator
    reads, unless this trace already answered it), or why there is none; None without a
    what-if (no trace channel)."""
    if not whatif.available:
        return None
    reason = unmodelled(change)
    if reason is not None:
        return Forecast(box_markup(Prediction(NOT_PREDICTED, dict(change), reason)))
    done = whatif.peek(change)
    if done is not None:
        return Forecast(box_markup(done))
    return Forecast(box_markup(pending(change)),
                    lambda: box_markup(whatif.predict([change])[0]))


def box_markup(p: Prediction) -> str:
    """The confirmation box's lines: where the numbers come from, then before → after (and
    the live figure) for `SHOWN`, `MARK` beside a rough one and the line that says why; or
    the status and its reason."""
    if not p.ready:
        style = "$text-muted" if p.status in (PENDING, UNAVAILABLE) else "$warning"
        return f"[{style}]{fmt.escape(p.headline())}[/]"
    source = "the engine's last " + (p.trace.describe() if p.trace else "trace")
    if p.trace is not None and p.trace.calibration.startswith("calibrated"):
        # One line in the box at 80 columns; the What-if screen says which calibration.
        source = source.replace("engine's ", "") + ", calibrated"
    flagged = p.rough
    stated = p.after_stated
    lines = [f"[b]predicted[/] [$text-muted]from {source}:[/]"]
    if p.overloaded or p.near_capacity:
        lines.append(f"[$warning]{fmt.escape(p.overload_line())}[/]")
    lines.append(f"[$text-muted]{'':14}{'now':>8}   {'after':<10}{'':7} {'±':>6} "
                 f"{'live':>8}[/]")
    for k in SHOWN:
        b, a, live = p.before.get(k), p.after.get(k), p.live.get(k)
        wait = wait_mark(k, p.after_info.get("overload"))
        grows = wait == GROWS
        after = GROWS if grows else figure(k, a)
        mark = f" [$warning]{MARK}[/]" if k in flagged else "  "
        change = "" if grows else change_pct(b, a)
        half = stated.get(k)
        width = "" if grows else wait or ("" if half is None else tolerance(half))
        lines.append(f"  {LABELS[k]:<12}{figure(k, b):>8} → {after}{mark}"
                     f"{'':{max(0, 8 - len(after))}}"
                     f"[{change_style(k, b, a)}]{change:>7}[/] "
                     f"[$text-muted]{width:>6} {figure(k, live):>8}[/]")
    note = p.rough_line()
    if note and any(k in flagged for k in SHOWN):
        lines.append(f"[$warning]{MARK} {fmt.escape(note)}[/]")
    elif p.coverage_line():          # one note under the figures: the box fits 80x24
        lines.append(f"[$text-muted]{fmt.escape(p.coverage_line())}[/]")
    return "\n".join(lines)
