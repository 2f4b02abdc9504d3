"""Structured-output requests in the console at 80x24: the Requests screen names each row's
constraint and its grammar's compile time, a compiling request shows as ``compiling`` (and in
the summary's count), the detail pane says the same, filters reach the constraint column, and
the Overview's step phases gain a ``grammar`` row while the bitmask costs time."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static

from support.console_testing import frames, replay_app, until
from vconsole.console.requests_view import grammar_label
from vconsole.console.widgets import panels
from vconsole.console.widgets.request_table import RequestTable
from vconsole.shared.stats import CONSTRAINT_KINDS

T0 = 1_700_000_000.0


def row(rid: str, state: str, constraint: int, compile_ms: float, age: float) -> dict[str, Any]:
    return {"id": rid, "state": state, "priority": 0, "num_prompt_tokens": 42,
            "num_output_tokens": 5, "num_blocks": 3, "age_s": age, "constraint": constraint,
            "compile_ms": compile_ms}


ROWS = [row("json-1", "running", 1 + CONSTRAINT_KINDS.index("json"), 12.4, 9.0),
        row("free-1", "running", 0, 0.0, 8.0),
        row("regex-1", "running", 1 + CONSTRAINT_KINDS.index("regex"), 0.3, 7.0),
        row("new-1", "compiling", 1 + CONSTRAINT_KINDS.index("json"), 0.0, 1.0)]


def sched(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"num_waiting": 0, "num_running": 3, "num_preempted": 0, "num_compiling": 1,
            "num_preemptions_total": 0, "num_finished_total": 0, "max_num_seqs": 8,
            "max_num_batched_tokens": 512, "policy": "fcfs", "requests": rows,
            "requests_truncated": False, "snapshot_ts": T0}


def test_the_grammar_label_names_the_kind_and_the_compile_time():
    assert grammar_label(ROWS[0]) == "json 12ms"
    assert grammar_label(ROWS[1]) == ""
    assert grammar_label(ROWS[2]) == "regex <1ms"
    assert grammar_label(ROWS[3]) == "json"            # still compiling: no time yet
    assert grammar_label({"id": "x", "state": "running"}) == ""   # a source without it
    assert grammar_label(row("o", "running", 2, 1.0, 1.0)) == "object 1ms"


async def test_the_requests_screen_marks_constrained_and_compiling_requests():
    app = replay_app(records=[(T0, frames("sched", sched(ROWS)))])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        await until(pilot, lambda: len(table.rows) == 4)
        lines = [table.render_line(y).text for y in range(4)]
        by_id = {line.split()[0]: line for line in lines}
        assert "json 12ms" in by_id["json-1"] and "regex <1ms" in by_id["regex-1"]
        assert "compiling" in by_id["new-1"] and "json" in by_id["new-1"]
        assert "ms" not in by_id["free-1"]
        assert all(len(line) <= 80 for line in lines)
        header = str(app.screen.query_one("#req-header", Static).render())
        assert "grammar" in header
        summary = str(app.screen.query_one("#req-summary", Static).render())
        assert "1 compiling" in summary

        await pilot.press("/")                       # the constrained rows only
        await pilot.press(*"grammar>0")
        await pilot.press("enter")
        await until(pilot, lambda: len(table.rows) == 3)
        assert "free-1" not in [r["id"] for r in table.rows]

        await pilot.press("enter")                   # the detail pane names the grammar
        pane = str(app.screen.query_one("#detail-figures", Static).render())
        assert "grammar json" in pane


class _Eng:
    def __init__(self, step: dict[str, Any]) -> None:
        self.latest = {"step": step}


LIMITS = {"alert_sched_share_warning": 0.15, "alert_step_time_warning_s": 0.5,
          "alert_step_time_critical_s": 2.0}


def _step(structured: float) -> dict[str, Any]:
    return {"steps": 10, "window_s": 1.0, "sched_share": 0.01, "step_time_p50_s": 0.05,
            "step_time_max_s": 0.07, "num_prefill_tokens": 0, "num_decode_tokens": 320,
            "phase_s": {"schedule": 0.005, "execute": 0.4, "update": 0.02,
                        "structured": structured}}


def test_the_phases_panel_shows_the_grammar_phase_only_while_it_costs_time():
    with_mask = panels.phases(_Eng(_step(0.075)), T0, 40, LIMITS)      # type: ignore[arg-type]
    line = next(x for x in with_mask.splitlines() if "grammar" in x)
    assert "15.0%" in line                     # 0.075 of 0.5 s
    without = panels.phases(_Eng(_step(0.0)), T0, 40, LIMITS)          # type: ignore[arg-type]
    assert "grammar" not in without and "execute" in without
