"""Filtering and sorting the request rows: pure functions over the ``sched`` topic's rows.

Filter syntax (every word must match, case-insensitive):

- ``abc`` — a substring of the request id or its state;
- ``state:running`` / ``id:req-12`` — a substring of that column;
- ``prio>0``, ``age>=30``, ``blocks<4``, ``output=0`` — a numeric comparison on a column.

A word that does not parse as a comparison falls back to substring matching, so typing never
raises. Sorting is stable and puts missing values last.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    width: int
    numeric: bool = True


COLUMNS = (
    Column("id", "id", 0, numeric=False),   # width 0: takes what is left
    Column("state", "state", 10, numeric=False),
    Column("priority", "prio", 5),
    Column("num_prompt_tokens", "prompt", 7),
    Column("num_output_tokens", "output", 7),
    Column("num_blocks", "blocks", 7),
    Column("age_s", "age", 8),
)
SORT_KEYS = [c.key for c in COLUMNS]
ALIASES = {"prio": "priority", "priority": "priority", "prompt": "num_prompt_tokens",
           "output": "num_output_tokens", "out": "num_output_tokens", "blocks": "num_blocks",
           "age": "age_s", "id": "id", "state": "state"}
TITLES = {c.key: c.title for c in COLUMNS}
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt, "<": operator.lt,
    "=": operator.eq,
}
_CMP = re.compile(r"^([a-z_]+)(>=|<=|!=|>|<|=|:)(.*)$")


def _predicate(word: str) -> Callable[[Row], bool]:
    m = _CMP.match(word)
    if m and m.group(1) in ALIASES:
        key, op, value = ALIASES[m.group(1)], m.group(2), m.group(3)
        if op == ":":
            return lambda r: value in str(r.get(key, "")).lower()
        try:
            num = float(value)
        except ValueError:
            pass
        else:
            fn = _OPS[op]

            def cmp(r: Row) -> bool:
                v = r.get(key)
                return isinstance(v, int | float) and fn(v, num)
            return cmp
    return lambda r: word in str(r.get("id", "")).lower() or word in str(r.get("state", ""))


def filter_rows(rows: Sequence[Row], query: str) -> list[Row]:
    words = query.lower().split()
    if not words:
        return list(rows)
    preds = [_predicate(w) for w in words]
    return [r for r in rows if all(p(r) for p in preds)]


def sort_rows(rows: list[Row], key: str, reverse: bool = False) -> list[Row]:
    """Sorted copy; rows lacking ``key`` go last whichever the direction."""
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]
    numeric = key not in ("id", "state")
    present.sort(key=(lambda r: r[key]) if numeric else (lambda r: str(r[key])),
                 reverse=reverse)
    return present + missing


def layout(width: int) -> list[tuple[Column, int]]:
    """Each column with the cells it gets at ``width``; id takes the rest (at least 8)."""
    fixed = sum(c.width for c in COLUMNS if c.width)
    id_w = max(8, width - fixed - 1)
    return [(c, c.width or id_w) for c in COLUMNS]
