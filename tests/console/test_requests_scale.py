"""The Requests screen at 10,000 rows: the table formats only the lines on screen, filtering
and sorting give exactly the right rows in the right order, and a snapshot the engine merely
re-sent (idle heartbeat, same ``snapshot_ts``) is not filtered and sorted again.
The time these take is `vconsole bench console`'s ``sort_filter_ms``, not a test."""

from __future__ import annotations

import pytest

from support.console_testing import big_sched, frames, replay_app
from vconsole.console.requests_view import SORT_KEYS, filter_rows, select, sort_rows
from vconsole.console.widgets.request_table import RequestTable
from vconsole.telemetry.schema import RequestColumns

T0 = 1_700_000_000.0
N = 10_000



def test_filtering_10k_rows_keeps_exactly_the_matching_ones_in_order():
    rows = big_sched(N)["requests"]
    got = filter_rows(rows, "state:waiting prio>3")
    assert got == [r for r in rows if r["state"] == "waiting" and r["priority"] > 3]
    assert len(got) == sum(1 for i in range(N) if i % 3 == 1 and i % 7 > 3)


def test_sorting_10k_rows_is_a_stable_permutation_in_key_order():
    rows = big_sched(N)["requests"]
    by_age = sort_rows(rows, "age_s", reverse=True)
    assert sorted(r["id"] for r in by_age) == [r["id"] for r in rows]   # nothing lost or added
    ages = [r["age_s"] for r in by_age]
    assert ages == sorted(ages, reverse=True)
    # Stable: rows with equal age keep their input (id) order.
    first = [r["id"] for r in by_age if r["age_s"] == ages[0]]
    assert first == sorted(first) and len(first) == N // 1000
    by_id = sort_rows(rows, "id")
    assert [r["id"] for r in by_id] == sorted(r["id"] for r in rows)


def test_sorting_puts_rows_without_the_key_last_in_both_directions():
    rows = big_sched(30)["requests"]
    rows[5] = {k: v for k, v in rows[5].items() if k != "num_blocks"}
    for reverse in (False, True):
        out = sort_rows(rows, "num_blocks", reverse=reverse)
        assert out[-1]["id"] == "req-000005" and len(out) == 30


@pytest.mark.slow
async def test_the_table_formats_only_the_visible_lines_of_10k_rows():
    app = replay_app(records=[(T0, frames("sched", big_sched(N), ts=T0))])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        assert len(table.rows) == N
        formatted: list[int] = []
        render_line = table.render_line

        def counting(y: int):
            formatted.append(round(table.scroll_y) + y)
            return render_line(y)

        table.render_line = counting  # type: ignore[method-assign]
        height = table.scrollable_content_region.height
        for keys in ((), ("pagedown", "pagedown"), ("end",)):
            await pilot.press(*keys)
            await pilot.pause()
            formatted.clear()
            table.refresh()                 # one full repaint at this scroll position
            await pilot.pause()
            top = round(table.scroll_y)
            assert formatted, "nothing was drawn"
            assert all(top <= i < top + height for i in formatted)
            assert len(set(formatted)) <= height < 100
        assert table.cursor == N - 1


@pytest.mark.slow
async def test_sort_and_filter_keys_reorder_all_10k_rows_on_screen():
    app = replay_app(records=[(T0, frames("sched", big_sched(N), ts=T0))])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        table = screen.query_one(RequestTable)
        screen.set_sort("priority", reverse=False)
        await pilot.pause()
        assert [r["id"] for r in table.rows] == [
            r["id"] for r in sort_rows(big_sched(N)["requests"], "priority")]
        screen.set_filter("state:preempted")
        await pilot.pause()
        assert len(table.rows) == N // 3
        assert {r["state"] for r in table.rows} == {"preempted"}
        prios = [r["priority"] for r in table.rows]
        assert prios == sorted(prios)


@pytest.mark.slow
async def test_a_resent_snapshot_is_not_sorted_again_but_a_new_one_is():
    app = replay_app(records=[(T0, frames("sched", big_sched(N), ts=T0))])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.query_one(RequestTable)
        shown = table.rows
        # The idle engine's heartbeat re-send: a new message, the same snapshot.
        app.state.ingest(frames("sched", big_sched(N), seq=1, ts=T0 + 1), T0 + 1)
        app.refresh_view(force=True)
        await pilot.pause()
        assert table.rows is shown
        newer = big_sched(N - 1, snapshot_ts=T0 + 2)
        app.state.ingest(frames("sched", newer, seq=2, ts=T0 + 2), T0 + 2)
        app.refresh_view(force=True)
        await pilot.pause()
        assert table.rows is not shown and len(table.rows) == N - 1


@pytest.mark.parametrize("query", ["", "state:waiting prio>3", "req-0001", "run", "age>=50",
                                   "blocks!=0 output<10", "prio:3", "nonsense>1x"])
@pytest.mark.parametrize("key", SORT_KEYS)
def test_columnar_select_gives_the_rows_and_order_of_filter_then_sort(query, key):
    """The screen filters and sorts numpy columns; the result is exactly the row version's."""
    rows = big_sched(3_000)["requests"]
    cols = RequestColumns.from_rows(rows)
    for reverse in (False, True):
        want = [r["id"] for r in sort_rows(filter_rows(rows, query), key, reverse)]
        assert [cols.ids[i] for i in select(cols, query, key, reverse)] == want


def test_columnar_select_puts_missing_values_last_in_both_directions():
    rows = big_sched(30)["requests"]
    rows[5] = {k: v for k, v in rows[5].items() if k != "num_blocks"}
    cols = RequestColumns.from_rows(rows)
    for reverse in (False, True):
        order = select(cols, "", "num_blocks", reverse)
        assert cols.ids[order[-1]] == "req-000005" and len(order) == 30
        assert [cols.ids[i] for i in order] == [
            r["id"] for r in sort_rows(rows, "num_blocks", reverse)]
