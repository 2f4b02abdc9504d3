"""The ``sched`` topic's request table as columns: its wire form and its decoded form.

On the wire (`vconsole.telemetry.schema.encode`), ``requests`` is a map: ``id`` a msgpack list
of str, ``state`` a uint8 code per row (``state_names`` lists the names by code:
`vconsole.shared.stats.REQUEST_STATES`, ``waiting``/``running``/``preempted``), and
``priority``, ``num_prompt_tokens``, ``num_output_tokens``, ``num_blocks`` (int32) and
``age_s`` (float64) raw buffers. Ten thousand rows are then one short msgpack list and six
frames sent without copies, instead of 70,000 msgpack numbers the publisher's thread would
pack while holding the GIL the engine's busy loop needs.

Decoded (`vconsole.telemetry.schema.decode`), it is a `RequestColumns`: numpy columns for the
console to filter and sort without a Python object per row, and still a sequence of row dicts
(``len``, indexing, iteration, `rows`) for callers that want rows. Older forms — a map of
column -> list (recordings made before the buffers) or a list of row maps (older still) — are
accepted and give the same object.

Invariants of a `RequestColumns`: every column has ``len(ids)`` entries; ``state`` holds
indices into ``state_names``; a numeric column is int64/int32 when every value was an integer,
float64 otherwise, with NaN standing for a missing value (`row` gives ``None`` for it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from vconsole.shared.stats import REQUEST_NUMERIC, REQUEST_STATES, RequestTable

REQUEST_COLUMNS = ("id", "state", *REQUEST_NUMERIC)
Row = dict[str, Any]


class RequestColumns(Sequence[Row]):
    """A decoded request table (see the module docstring). Read-only by convention: a
    decoded message may be shared by several readers."""

    __slots__ = ("ids", "state", "state_names", "numeric", "_labels")

    def __init__(self, ids: list[str], state: np.ndarray, state_names: Sequence[str],
                 numeric: dict[str, np.ndarray]) -> None:
        self.ids = ids
        self.state = state
        self.state_names = tuple(state_names)
        self.numeric = numeric
        self._labels: np.ndarray | None = None

    # --- the sequence of rows ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...
    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return [self.row(j) for j in range(*i.indices(len(self)))]
        return self.row(i)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        """Equal to a list of the same row maps (what `decode` returned before columns), or to
        another `RequestColumns` with the same rows."""
        if isinstance(other, RequestColumns | list):
            return len(self) == len(other) and self.rows() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RequestColumns({len(self)} rows)"

    def row(self, i: int) -> Row:
        """Row ``i`` as the map the ``sched`` topic documents (Python values)."""
        out: Row = {"id": self.ids[i], "state": self.state_names[int(self.state[i])]}
        for k, col in self.numeric.items():
            v = col[i].item()
            out[k] = None if v != v else v   # NaN: missing
        return out

    def rows(self) -> list[Row]:
        """Every row as a map (for JSON and for callers that want rows; costs a dict a row)."""
        names = ["id", "state", *self.numeric]
        lists = [self.ids, self.labels().tolist(),
                 *(_py_list(c) for c in self.numeric.values())]
        return [dict(zip(names, vals, strict=True)) for vals in zip(*lists, strict=True)]

    # --- columns ------------------------------------------------------------------------------

    def labels(self) -> np.ndarray:
        """The state name per row (an object array, built once)."""
        if self._labels is None:
            self._labels = np.array(self.state_names, dtype=object)[self.state] \
                if len(self.state_names) else np.empty(0, dtype=object)
        return self._labels

    def column(self, key: str) -> np.ndarray | None:
        """``key``'s values as an array (``id`` and ``state`` as object arrays of str); None
        when the table has no such column."""
        if key == "id":
            return np.array(self.ids, dtype=object)
        if key == "state":
            return self.labels()
        return self.numeric.get(key)

    def index_of(self, request_id: str) -> int | None:
        try:
            return self.ids.index(request_id)
        except ValueError:
            return None

    # --- building -----------------------------------------------------------------------------

    @classmethod
    def from_rows(cls, rows: Sequence[Row]) -> RequestColumns:
        """From a list of row maps (the oldest wire form, and tests)."""
        keys = list(REQUEST_COLUMNS)
        for r in rows:
            keys += [k for k in r if k not in keys]
        return cls.from_lists({k: [r.get(k) for r in rows] for k in keys})

    @classmethod
    def from_lists(cls, cols: dict[str, Any]) -> RequestColumns:
        """From a map of column -> list or array (older recordings; a `RequestTable`'s
        columns). Raises ValueError when columns differ in length or hold odd values."""
        data = {k: v for k, v in cols.items() if k != "state_names"}
        n = len(next(iter(data.values()), ()))
        if any(len(v) != n for v in data.values()):
            raise ValueError("'requests' columns must be of equal length")
        ids = list(data.get("id", [""] * n))
        if set(map(type, ids)) - {str}:
            ids = ["" if x is None else str(x) for x in ids]
        state, names = _state_codes(cols.get("state"), n, cols.get("state_names"))
        numeric = {k: _numeric(v) for k, v in data.items() if k not in ("id", "state")}
        return cls(ids, state, names, numeric)


def _py_list(col: np.ndarray) -> list[Any]:
    out = col.tolist()
    if col.dtype.kind == "f" and np.isnan(col).any():
        out = [None if v != v else v for v in out]
    return out


def _numeric(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        return values
    try:
        arr = np.asarray(values, dtype=np.float64)     # None -> NaN
    except (TypeError, ValueError) as e:
        raise ValueError(f"'requests' numeric column holds a non-number: {e}") from None
    if arr.ndim != 1:
        raise ValueError("'requests' columns must be flat")
    if not np.isnan(arr).any() and all(isinstance(v, int) for v in values):
        return np.asarray(values, dtype=np.int64)
    return arr


def _state_codes(values: Any, n: int, names: Any) -> tuple[np.ndarray, tuple[str, ...]]:
    """(uint8 codes, names by code) from codes (with ``names``) or from names per row."""
    if values is None:
        return np.zeros(n, np.uint8), ("?",)
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        table = tuple(str(x) for x in names) if names is not None else REQUEST_STATES
        if n and int(values.max()) >= len(table):
            raise ValueError(f"'requests' state code {int(values.max())} has no name")
        return values.astype(np.uint8, copy=False), table
    table_list = list(REQUEST_STATES)
    index = {s: i for i, s in enumerate(table_list)}
    codes = np.empty(n, np.uint8)
    for i, s in enumerate(values):
        s = str(s)
        code = index.get(s)
        if code is None:
            if len(table_list) >= 255:
                raise ValueError("'requests' has too many distinct states")
            code = index[s] = len(table_list)
            table_list.append(s)
        codes[i] = code
    return codes, tuple(table_list)


def to_wire(requests: Any) -> dict[str, Any]:
    """Any accepted form of the table -> its wire map (numpy arrays, which `encode` turns
    into buffer frames). A `RequestTable`'s arrays go as they are: no Python per row."""
    if isinstance(requests, RequestTable):
        cols = requests.columns
        out: dict[str, Any] = {"id": cols["id"], "state": cols["state"],
                               "state_names": list(REQUEST_STATES)}
        for k, dt in REQUEST_NUMERIC.items():
            if k in cols:   # a table made before a column existed lacks it
                out[k] = np.asarray(cols[k], dtype=dt)
        return out
    if isinstance(requests, RequestColumns):
        rc = requests
    elif isinstance(requests, dict):
        rc = RequestColumns.from_lists(requests)
    else:
        rc = RequestColumns.from_rows(list(requests))
    out = {"id": rc.ids, "state": rc.state, "state_names": list(rc.state_names)}
    for k, col in rc.numeric.items():
        wire_type = REQUEST_NUMERIC.get(k)
        out[k] = (col.astype(wire_type) if wire_type is not None and not np.isnan(col).any()
                  else col)
    return out


def from_wire(obj: Any, view: Any) -> RequestColumns:
    """The wire map (or an older form) -> `RequestColumns`; ``view(ref)`` turns a buffer
    reference into its array. Raises ValueError saying what is wrong."""
    if isinstance(obj, list):
        if not all(isinstance(r, dict) for r in obj):
            raise ValueError("'requests' rows must be maps")
        return RequestColumns.from_rows(obj)
    if not isinstance(obj, dict):
        raise ValueError("'requests' must be a column map or a list of rows")
    cols: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            v = view(v)
            if v.ndim != 1:
                raise ValueError(f"'requests' column {k!r} must be one-dimensional")
        elif not isinstance(v, list):
            raise ValueError(f"'requests' column {k!r} must be a list or a buffer")
        cols[k] = v
    if "state_names" in cols and not isinstance(cols.get("state"), np.ndarray):
        raise ValueError("'requests' state_names given but state is not codes")
    return RequestColumns.from_lists(cols)
