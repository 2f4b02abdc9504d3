"""A fleet read without the console: `FleetWatch` (every target's source feeding one
`ConsoleState`), for ``vconsole top`` with targets and the fleet bench; `snapshot` is
``top --once --json``'s document."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from vconsole.console.sources.fleet.detect import resolve
from vconsole.console.sources.fleet.imbalance import findings
from vconsole.console.sources.fleet.rows import Fleet, FleetRow
from vconsole.console.sources.fleet.sources import EngineSource, ScrapeSource, source_for
from vconsole.console.sources.fleet.targets import Target, TargetError
from vconsole.console.state import ConsoleState


def build_sources(targets: Sequence[Target], *, interval_s: float = 1.0
                  ) -> tuple[list[ScrapeSource | EngineSource], list[str]]:
    """A source per target (``auto`` ones detected first); one line per target that could not
    be resolved (left out)."""
    sources: list[ScrapeSource | EngineSource] = []
    problems: list[str] = []
    for t in targets:
        try:
            sources.append(source_for(resolve(t), interval_s=interval_s))
        except TargetError as e:
            problems.append(f"{t.name}: {e}")
    return sources, problems


class FleetWatch:
    """Every target's source running into one state; ``rows`` as the Fleet screen has them."""

    def __init__(self, sources: Sequence[ScrapeSource | EngineSource], *,
                 window_s: float = 60.0) -> None:
        self.state = ConsoleState()
        self.sources = list(sources)
        self.fleet = Fleet(self.sources, window_s=window_s, started=time.time())

    def start(self) -> FleetWatch:
        for s in self.sources:
            s.start(self.state)
        self.state.clock = time.time
        return self

    def stop(self) -> None:
        for s in self.sources:
            s.stop()

    def rows(self) -> list[FleetRow]:
        return self.fleet.rows(self.state, time.time())

    def settled(self) -> bool:
        """Every target is up with two reads behind its rates, or plainly not answering."""
        rows = self.rows()
        models = all(getattr(s, "model", "") is not None for s in self.sources)
        return models and all(r.state == "down" or (r.state == "up" and r.gen_tok_s is not None)
                              for r in rows)


def document(rows: Sequence[FleetRow], now: float) -> dict[str, Any]:
    """``{"engines": [...], "aggregate": {...}, "imbalance": [...]}`` (null where unknown)."""
    return {"engines": [r.json() for r in rows],
            "aggregate": Fleet.aggregate(rows).json(),
            "imbalance": [f.json() for f in findings(rows, now)]}


def snapshot(targets: Sequence[Target], timeout_s: float = 10.0, interval_s: float = 1.0
             ) -> tuple[dict[str, Any], list[str]]:
    """``top --once --json``: read every target until each has two reads (or is down, or the
    time is up); percentiles since each server started. (document, problems)."""
    sources, problems = build_sources(targets, interval_s=interval_s)
    watch = FleetWatch(sources, window_s=0.0).start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not watch.settled():
            time.sleep(0.1)
        rows = watch.rows()
    finally:
        watch.stop()
    problems += [f"{r.name}: {r.problem}" for r in rows if r.problem]
    return document(rows, time.time()), problems
