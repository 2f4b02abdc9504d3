"""What the Fleet screen does to its rows, without Textual: filter, sort, group by model, and
each cell's text.

Filter terms (space-separated, all must hold), as the Requests screen's: ``kind:llama-cpp``,
``state:down``, ``model:qwen``, a comparison on a figure (``waiting>0``, ``kv>=0.8``,
``running=0``), a label (``pool=a100``), else a word found in the name, kind or model.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

from vconsole.console import format as fmt
from vconsole.console.sources.fleet.merge import Percentile
from vconsole.console.sources.fleet.rows import FleetRow

FIGURES: dict[str, Callable[[FleetRow], float | None]] = {
    "running": lambda r: r.running, "waiting": lambda r: r.waiting,
    "kv": lambda r: r.kv_usage, "tok": lambda r: r.gen_tok_s,
    "ttft": lambda r: r.ttft_p99.value, "itl": lambda r: r.itl_p99.value,
    "hit": lambda r: r.prefix_hit, "preempt": lambda r: r.preemptions_per_min,
}
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt,
    "<": operator.lt, "=": operator.eq}
_TERM = re.compile(r"^([a-z_]+)(>=|<=|!=|>|<|=)(.+)$")
SORTS = ("name", "kind", "state", "running", "waiting", "kv", "tok", "ttft", "itl")
_STATE_ORDER = {"down": 0, "stale": 1, "starting": 2, "up": 3}


def _term_holds(row: FleetRow, term: str) -> bool:
    key, sep, value = term.partition(":")
    if sep and key in ("kind", "state", "model", "name"):
        return value.lower() in str(getattr(row, key) or "").lower()
    m = _TERM.match(term)
    if m is not None:
        name, op, text = m.groups()
        if name in FIGURES:
            v = FIGURES[name](row)
            try:
                return v is not None and _OPS[op](v, float(text))
            except ValueError:
                return False
        if name in row.labels and op in ("=", "!="):
            return _OPS[op](row.labels[name], text)
        return False
    word = term.lower()
    return any(word in str(x or "").lower() for x in (row.name, row.kind, row.model,
                                                      *row.labels.values()))


def filter_rows(rows: Sequence[FleetRow], text: str) -> list[FleetRow]:
    terms = text.split()
    return [r for r in rows if all(_term_holds(r, t) for t in terms)]


def sort_rows(rows: Sequence[FleetRow], key: str, reverse: bool = False) -> list[FleetRow]:
    """By ``key`` (`SORTS`); unknown figures last whatever the direction."""
    if key in ("name", "kind"):
        return sorted(rows, key=lambda r: str(getattr(r, key)), reverse=reverse)
    if key == "state":
        return sorted(rows, key=lambda r: _STATE_ORDER.get(r.state, 0), reverse=reverse)
    get = FIGURES[key]
    known = sorted((r for r in rows if get(r) is not None), key=lambda r: get(r) or 0.0,
                   reverse=not reverse)
    return known + [r for r in rows if get(r) is None]


def group_by_model(rows: Sequence[FleetRow]) -> list[tuple[str, list[FleetRow]]]:
    groups: dict[str, list[FleetRow]] = {}
    for r in rows:
        groups.setdefault(r.model or "(model unknown)", []).append(r)
    return sorted(groups.items())


def percentile_text(p: Percentile) -> str:
    """``25ms``, or its bounds where it is known only as one (``0.1–1s``, ``> 10s``)."""
    if p.value is None:
        return "–"
    if p.bound is None:
        return fmt.ms(p.value)
    lo, hi = p.bound
    return fmt.bounded_ms(p.value, {"lo": lo, "hi": hi})


def state_text(row: FleetRow, now: float) -> str:
    """``up 12s``, ``down 4m05s``: the state and for how long (whole seconds)."""
    age = max(0.0, now - row.since)
    return f"{row.state} {int(age)}s" if age < 60 else f"{row.state} {fmt.duration(age)}"


def kv_text(row: FleetRow) -> str:
    if row.kv_usage is None:
        return "–"
    return fmt.pct(row.kv_usage, 0) + ("~" if row.kv_usage_estimated else "")


def cells(row: FleetRow, now: float) -> dict[str, str]:
    """The row's text per column key of the Fleet screen."""
    def n(v: float | None, digits: int = 0) -> str:
        return "–" if v is None else f"{v:.{digits}f}"
    return {
        "name": fmt.clip_middle(row.name, 16), "kind": row.kind,
        "model": fmt.clip((row.model or "–").split("/")[-1], 14),
        "state": state_text(row, now), "running": n(row.running), "waiting": n(row.waiting),
        "kv": kv_text(row), "tok": n(row.gen_tok_s),
        "ttft50": percentile_text(row.ttft_p50), "ttft99": percentile_text(row.ttft_p99),
        "itl99": percentile_text(row.itl_p99),
        "hit": "–" if row.prefix_hit is None else fmt.pct(row.prefix_hit, 0),
        "preempt": n(row.preemptions_per_min, 1),
        "alerts": ",".join(row.alerts) or ("!" + (row.problem or "")[:40] if row.problem
                                          else ""),
    }
