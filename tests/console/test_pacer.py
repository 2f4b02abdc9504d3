"""The refresh pacer (`vconsole.console.pacer.RefreshPacer`) on a clock the test moves: a token
bucket of ``rate_hz`` a second, at most ``burst`` saved up, and the age tick. (The app's use of
it, wake-ups held and shown: test_console_app.py.)"""

from __future__ import annotations

import pytest

from vconsole.console.pacer import AGE_TICK_S, WAKE_BURST, RefreshPacer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_is_shown_at_once_then_the_next_waits_for_its_token() -> None:
    clock = Clock()
    pacer = RefreshPacer(10.0, clock=clock)
    assert pacer.interval_s == pytest.approx(0.1) and WAKE_BURST == 2.0
    assert pacer.spend() == 0.0 and pacer.spend() == 0.0      # two saved up
    assert pacer.spend() == pytest.approx(0.1)                # the third: a period away
    clock.t += 0.04
    assert pacer.spend() == pytest.approx(0.06)               # a waiting wake-up spends nothing
    clock.t += 0.06
    assert pacer.spend() == 0.0


def test_a_forced_refresh_goes_into_debt_and_the_next_waits_longer() -> None:
    clock = Clock()
    pacer = RefreshPacer(10.0, clock=clock)
    pacer.spend(), pacer.spend()
    assert pacer.spend(force=True) == 0.0                     # the held refresh, due now
    assert pacer.spend() == pytest.approx(0.2)


def test_an_idle_pause_saves_up_no_more_than_the_burst() -> None:
    clock = Clock()
    pacer = RefreshPacer(5.0, clock=clock)
    clock.t += 60.0
    assert [pacer.spend() for _ in range(2)] == [0.0, 0.0]
    assert pacer.spend() == pytest.approx(0.2)


def test_the_age_tick_is_due_only_when_nothing_refreshed_for_a_while() -> None:
    clock = Clock()
    pacer = RefreshPacer(10.0, clock=clock)
    pacer.refreshed()
    assert not pacer.tick_due()
    clock.t += AGE_TICK_S - 0.01
    assert not pacer.tick_due()
    clock.t += 0.01
    assert pacer.tick_due()
    pacer.refreshed()                                         # a wake-up's refresh resets it
    assert not pacer.tick_due()
