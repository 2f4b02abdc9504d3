"""Speculative decoding as the console shows it, from the ``sched`` topic's ``spec_decode``
(present only where the engine has a ``speculative_config``): the acceptance rate (accepted
draft tokens / drafted tokens) and the tokens per step of a row that ran a draft (vLLM's mean
acceptance length: 1 + accepted / drafts), since the engine started; per request the same
from its own counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def rates(num_drafts: float, num_draft_tokens: float, num_accepted: float
          ) -> tuple[float | None, float | None]:
    """(acceptance rate, tokens per draft step); None where nothing was drafted."""
    acceptance = num_accepted / num_draft_tokens if num_draft_tokens else None
    per_step = 1.0 + num_accepted / num_drafts if num_drafts else None
    return acceptance, per_step


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _per_step(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def summary(sc: Mapping[str, Any] | None) -> str | None:
    """One line of markup for the Overview, or None when speculation is not configured."""
    spec = (sc or {}).get("spec_decode")
    if not spec:
        return None
    acceptance, per_step = rates(spec.get("num_drafts", 0), spec.get("num_draft_tokens", 0),
                                 spec.get("num_accepted_tokens", 0))
    state = "[$success]on[/]" if spec.get("enabled", True) else "[$warning]paused[/]"
    return (f"[$text-muted]spec[/] {state} k={spec.get('num_speculative_tokens', '?')} "
            f"[$text-muted]accept[/] [b]{_pct(acceptance)}[/] "
            f"[$text-muted]tok/step[/] [b]{_per_step(per_step)}[/]")


def of_request(sc: Mapping[str, Any] | None, request_id: str) -> str | None:
    """The request's own figures (plain text), or None when it has not drafted."""
    spec = (sc or {}).get("spec_decode") or {}
    counts: Sequence[float] | None = (spec.get("requests") or {}).get(request_id)
    if not counts:
        return None
    drafts, drafted, accepted = counts[0], counts[1], counts[2]
    acceptance, per_step = rates(drafts, drafted, accepted)
    return (f"spec {int(accepted):,}/{int(drafted):,} accepted ({_pct(acceptance)}) · "
            f"{_per_step(per_step)} tok/step")
