"""The ``sched`` request table on the wire: typed buffers from the scheduler's columns, and a
decoded `RequestColumns` that reads the same whichever wire form (today's buffers, the older
column lists, the oldest row list) a message or a recording carries."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from vconsole.engine.request import RequestStatus
from vconsole.shared.stats import REQUEST_NUMERIC, REQUEST_STATES, RequestRow, RequestTable
from vconsole.telemetry.schema import (
    REQUEST_COLUMNS,
    RequestColumns,
    SchemaError,
    decode,
    encode,
    make_envelope,
)

ROWS = [{"id": f"req-{i}", "state": REQUEST_STATES[i % 3], "priority": i % 5 - 2,
         "num_prompt_tokens": 100 + i, "num_output_tokens": i, "num_blocks": i // 3,
         "age_s": i / 4, "constraint": i % 6, "compile_ms": i / 2} for i in range(40)]


def sched(requests: object) -> dict[str, object]:
    return {**make_envelope("e", 0, 0, time.time()), "num_waiting": 1, "requests": requests}


def table(rows: list[dict[str, object]]) -> RequestTable:
    cols: dict[str, object] = {"id": [r["id"] for r in rows],
                               "state": np.array([REQUEST_STATES.index(str(r["state"]))
                                                  for r in rows], np.uint8)}
    for k, dt in REQUEST_NUMERIC.items():
        cols[k] = np.array([r[k] for r in rows], dt)
    return RequestTable(cols)


def test_state_codes_are_the_engines_request_status_values():
    assert tuple(s.label for s in RequestStatus)[:len(REQUEST_STATES)] == REQUEST_STATES
    assert tuple(RequestRow.__dataclass_fields__) == REQUEST_COLUMNS


def test_a_request_table_travels_as_typed_buffers_and_decodes_to_the_same_rows():
    frames = encode("sched", sched(table(ROWS)))
    wire = msgpack.unpackb(frames[1], raw=False)["requests"]
    assert wire["id"] == [r["id"] for r in ROWS]
    assert wire["state_names"] == list(REQUEST_STATES)
    dtypes = {k: wire[k]["dtype"] for k in ("state", *REQUEST_NUMERIC)}
    assert dtypes == {"state": "uint8", "priority": "int32", "num_prompt_tokens": "int32",
                      "num_output_tokens": "int32", "num_blocks": "int32",
                      "age_s": "float64", "constraint": "uint8", "compile_ms": "float32"}
    assert len(frames) == 2 + 8                     # one raw frame per typed column
    got = decode([bytes(f) for f in frames]).payload["requests"]
    assert isinstance(got, RequestColumns) and len(got) == 40
    assert got.rows() == ROWS and list(got) == ROWS and got[7] == ROWS[7]
    assert got[2:4] == ROWS[2:4]
    assert got.numeric["priority"].dtype == np.int32 and not got.numeric["age_s"].flags.writeable
    assert type(got[3]["num_blocks"]) is int and type(got[3]["age_s"]) is float


@pytest.mark.parametrize("form", ["row list", "column lists", "columns"])
def test_older_wire_forms_decode_to_the_same_columns(form):
    """Recordings made before the buffers hold column lists, older ones a list of rows."""
    if form == "row list":
        frames = [b"sched", msgpack.packb(sched(ROWS))]
    elif form == "column lists":
        frames = [b"sched", msgpack.packb(sched({c: [r[c] for r in ROWS]
                                                 for c in REQUEST_COLUMNS}))]
    else:
        frames = encode("sched", sched(RequestColumns.from_rows(ROWS)))
    got = decode(frames).payload["requests"]
    assert isinstance(got, RequestColumns) and got.rows() == ROWS
    assert got.labels().tolist() == [r["state"] for r in ROWS]


def test_missing_values_and_unknown_states_survive_the_round_trip():
    rows = [dict(r) for r in ROWS[:4]]
    rows[1].pop("num_blocks")
    rows[2]["state"] = "swapped"                     # a state this code does not know
    got = decode(encode("sched", sched(rows))).payload["requests"]
    assert got[1]["num_blocks"] is None and got[0]["num_blocks"] == 0
    assert [r["state"] for r in got] == ["waiting", "running", "swapped", "waiting"]


def test_an_empty_table_is_an_empty_sequence():
    for empty in ([], table([]), {c: [] for c in REQUEST_COLUMNS}):
        got = decode(encode("sched", sched(empty))).payload["requests"]
        assert len(got) == 0 and got == [] and not got


@pytest.mark.parametrize("bad", [
    {"id": ["a", "b"], "priority": [1]},                 # columns of different lengths
    {"id": ["a"], "priority": ["high"]},                 # not a number
    "rows",                                              # neither map nor list
])
def test_a_bad_request_table_is_a_schema_error_saying_so(bad):
    with pytest.raises(SchemaError, match="requests"):
        decode([b"sched", msgpack.packb(sched(bad))])


def test_a_state_code_without_a_name_is_a_schema_error():
    frames = encode("sched", sched(table(ROWS[:3])))
    payload = msgpack.unpackb(frames[1], raw=False)
    payload["requests"]["state_names"] = ["waiting"]
    with pytest.raises(SchemaError, match="state code"):
        decode([frames[0], msgpack.packb(payload), *frames[2:]])
