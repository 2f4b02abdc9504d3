"""Filtering and sorting the request rows: pure functions over the ``sched`` topic's rows.

`select` is what the Requests screen uses: it works on the decoded columns
(`vconsole.telemetry.request_columns.RequestColumns`) with numpy masks and a stable argsort and returns
the row order, so 10,000 rows cost no dict per row; only the lines on screen are ever built.
`filter_rows` / `sort_rows` do the same over a list of row maps (the reference `select` is
tested against).

Filter syntax (every word must match, case-insensitive):

- ``abc`` — a substring of the request id or its state;
- ``state:running`` / ``id:req-12`` — a substring of that column;
- ``prio>0``, ``age>=30``, ``blocks<4``, ``output=0`` — a numeric comparison on a column;
  ``grammar>0`` keeps the structured-output requests, ``compile>=10`` the slow compiles.

A word without ``< > = !`` is a substring search. A word with one that is not a comparison
of a numeric column with a number (``prio>>x``, ``age>soon``, ``state>3``, ``foo>1``) is not
understood: `not_understood` names it, the screen says so, and it filters nothing (it is
ignored rather than silently searched for as text), so typing never raises. Sorting is stable (ties keep their input order in either direction, as Python's
``sort(reverse=True)``) and puts missing values last.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vconsole.shared.stats import CONSTRAINT_KINDS
from vconsole.telemetry.schema import RequestColumns

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
    # A structured-output request's constraint and its grammar's compile time (`grammar_label`).
    Column("constraint", "grammar", 12, numeric=False),   # a code on the wire, text on screen
    Column("age_s", "age", 8),
)
SORT_KEYS = [c.key for c in COLUMNS]
ALIASES = {"prio": "priority", "priority": "priority", "prompt": "num_prompt_tokens",
           "output": "num_output_tokens", "out": "num_output_tokens", "blocks": "num_blocks",
           "age": "age_s", "id": "id", "state": "state", "grammar": "constraint",
           "constraint": "constraint", "compile": "compile_ms", "compile_ms": "compile_ms"}
TITLES = {c.key: c.title for c in COLUMNS}
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt, "<": operator.lt,
    "=": operator.eq,
}
_CMP = re.compile(r"^([a-z_]+)(>=|<=|!=|>|<|=|:)(.*)$")
_DIGITS = re.compile(r"(\d+)")


_OP_CHARS = frozenset("<>=!")
NUMERIC_KEYS = frozenset(c.key for c in COLUMNS if c.numeric) | {"constraint", "compile_ms"}


def grammar_label(row: Row) -> str:
    """``json 3ms``: a row's structured-output constraint (the ``constraint`` code, 0 none, else
    1 + its index in `CONSTRAINT_KINDS`) and its grammar's compile time once compiled (a
    cache hit reads ``<1ms``); empty for an unconstrained row (or a source without the column)."""
    code = row.get("constraint")
    if not code or not 0 < int(code) <= len(CONSTRAINT_KINDS):
        return ""
    kind = CONSTRAINT_KINDS[int(code) - 1].replace("json_object", "object")
    ms = row.get("compile_ms")
    if row.get("state") == "compiling" or ms is None:
        return kind
    return f"{kind} {ms:.0f}ms" if ms >= 1 else f"{kind} <1ms"


def _understood(word: str) -> bool:
    """A plain word, ``column:text``, or ``numeric-column OP number``."""
    if not _OP_CHARS & set(word):
        return True
    m = _CMP.match(word)
    if not m or m.group(1) not in ALIASES:
        return False
    key, op, value = ALIASES[m.group(1)], m.group(2), m.group(3)
    if op == ":":
        return True
    try:
        float(value)
    except ValueError:
        return False
    return key in NUMERIC_KEYS


def not_understood(query: str) -> list[str]:
    """The words of ``query`` that look like a comparison but are not one (they are ignored)."""
    return [w for w in query.lower().split() if not _understood(w)]


def _words(query: str) -> list[str]:
    """The words that filter: every word but the ones `not_understood` names."""
    return [w for w in query.lower().split() if _understood(w)]


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
    words = _words(query)
    if not words:
        return list(rows)
    preds = [_predicate(w) for w in words]
    return [r for r in rows if all(p(r) for p in preds)]


def sort_rows(rows: list[Row], key: str, reverse: bool = False) -> list[Row]:
    """Sorted copy; rows lacking ``key`` go last whichever the direction."""
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]
    if key == "id":
        present.sort(key=lambda r: natural_key(str(r[key])), reverse=reverse)
    else:
        numeric = key != "state"
        present.sort(key=(lambda r: r[key]) if numeric else (lambda r: str(r[key])),
                     reverse=reverse)
    return present + missing


@functools.lru_cache(maxsize=1 << 16)
def natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """Ids in the order a person expects: ``c-18`` before ``c-132`` (digit runs compare as
    numbers). Cached: the same ids come back at every refresh."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in _DIGITS.split(text) if part)


def layout(width: int) -> list[tuple[Column, int]]:
    """Each column with the cells it gets at ``width``; id takes the rest (at least 8)."""
    fixed = sum(c.width for c in COLUMNS if c.width)
    id_w = max(8, width - fixed - 1)
    return [(c, c.width or id_w) for c in COLUMNS]


# --- columnar (numpy) ------------------------------------------------------------------------

def _strings(cols: RequestColumns, key: str) -> list[str]:
    if key == "id":
        return cols.ids
    if key == "state":
        return list(cols.labels())
    col = cols.numeric.get(key)
    if col is None:
        return [""] * len(cols)
    return ["None" if v != v else str(v) for v in col.tolist()]


def _mask(cols: RequestColumns, word: str) -> np.ndarray:
    """The rows ``word`` matches (the rules of `_predicate`, over whole columns)."""
    m = _CMP.match(word)
    if m and m.group(1) in ALIASES:
        key, op, value = ALIASES[m.group(1)], m.group(2), m.group(3)
        if op == ":" and key == "state":
            names = np.array([value in n.lower() for n in cols.state_names] + [False], bool)
            return names[cols.state]
        if op == ":":
            return np.fromiter((value in s.lower() for s in _strings(cols, key)), bool,
                               len(cols))
        try:
            num = float(value)
        except ValueError:
            pass
        else:
            col = cols.numeric.get(key)
            if col is None:
                return np.zeros(len(cols), bool)
            out = np.asarray(_OPS[op](col, num), bool)
            return out & ~np.isnan(col) if col.dtype.kind == "f" else out
    names = np.array([word in name for name in cols.state_names] + [False], bool)
    in_state = names[cols.state] if len(cols) else np.zeros(0, bool)
    in_id = np.fromiter((word in s.lower() for s in cols.ids), bool, len(cols))
    return in_id | in_state


def _stable_argsort(values: np.ndarray, reverse: bool) -> np.ndarray:
    if not reverse:
        return np.argsort(values, kind="stable")
    # Python's reverse=True: reverse, stable ascending sort, reverse again.
    n = len(values)
    return (n - 1 - np.argsort(values[::-1], kind="stable"))[::-1]


def select(cols: RequestColumns, query: str, key: str, reverse: bool = False) -> np.ndarray:
    """Row indices of ``cols`` matching ``query``, in ``key`` order (stable, missing last):
    the same rows in the same order as ``sort_rows(filter_rows(rows, query), key, reverse)``."""
    idx = np.arange(len(cols))
    words = _words(query)
    if words:
        mask = np.ones(len(cols), bool)
        for w in words:
            mask &= _mask(cols, w)
        idx = idx[mask]
    if key == "state":
        rank = np.empty(len(cols.state_names), np.int64)
        rank[np.argsort(np.array(cols.state_names, dtype=object), kind="stable")] = \
            np.arange(len(cols.state_names))
        return idx[_stable_argsort(rank[cols.state[idx]], reverse)]
    if key == "id":
        ids = cols.ids
        return np.array(sorted(idx.tolist(), key=lambda i: natural_key(ids[i]),
                               reverse=reverse), dtype=idx.dtype)
    col = cols.numeric.get(key)
    if col is None:
        return idx
    values = col[idx]
    if values.dtype.kind == "f":
        missing = np.isnan(values)
        if missing.any():
            present = idx[~missing]
            return np.concatenate((present[_stable_argsort(values[~missing], reverse)],
                                   idx[missing]))
    return idx[_stable_argsort(values, reverse)]
