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

from vconsole.console.predictions import (
    NOT_PREDICTED,
    Change,
    Prediction,
    WhatIf,
    box_markup,
    pending,
    unmodelled,
)


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
