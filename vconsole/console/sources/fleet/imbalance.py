"""The fleet's imbalance rules: what one engine's row says against the others'.

- ``queue_imbalance``: one replica's waiting queue far above the fleet's median while another
  replica has none waiting (requests go to the wrong place: a router problem);
- ``ttft_imbalance``: one replica's TTFT p99 far above the median of the others';
- ``kv_skew``: KV use spread wide across replicas (one full, one empty);
- ``down`` / ``stale``: a replica not answering, with how long.

Each finding names its engine and carries its evidence (the figures it was judged on), for the
Fleet screen, ``vconsole top --json``'s ``imbalance``, the Alerts screen and the Advice screen
(with what to do: `REMEDY`; no config change fixes a router).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vconsole.console.engine_state import Alert
from vconsole.console.sources.fleet.rows import Fleet, FleetRow
from vconsole.console.state import ConsoleState

QUEUE_MIN = 4            # waiting requests before a queue counts as long
QUEUE_FACTOR = 3.0       # ... and this many times the fleet's median
TTFT_FACTOR = 3.0
TTFT_MIN_S = 0.5
KV_SKEW = 0.5            # max - min KV use across replicas

# What an operator does about each finding: the Advice screen's fleet section.
REMEDY = {
    "queue_imbalance": "the router sends this replica more than its share: check its balancing "
                       "policy (least-outstanding-requests rather than round robin) and "
                       "whether the others are in its pool",
    "ttft_imbalance": "this replica is slower than its peers: compare its config and hardware "
                      "(drill in: Config, Step phases), or give it less weight in the router",
    "kv_skew": "KV use is uneven: the full replica preempts while others have room; route by "
               "KV use or prefix affinity, or give the full one a larger pool",
    "down": "not answering: restart it, or take it out of the router until it is back",
    "stale": "answering late: look at its host's load and its network; the figures shown are "
             "old",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    engine: str
    level: str           # "warning" or "critical"
    message: str
    evidence: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return {"rule": self.rule, "engine": self.engine, "level": self.level,
                "message": self.message, "evidence": self.evidence}


def findings(rows: Sequence[FleetRow], now: float) -> list[Finding]:
    out: list[Finding] = []
    for r in rows:
        if r.state in ("down", "stale"):
            why = f": {short(r.problem, r.url)}" if r.problem else ""
            out.append(Finding(r.state, r.name, "critical" if r.state == "down" else "warning",
                               f"{r.name} {r.state} for {now - r.since:.0f}s{why}",
                               {"state": r.state, "for_s": round(now - r.since, 1)}))
    up = [r for r in rows if r.state == "up"]
    out += _queues(up) + _ttft(up) + _kv(up)
    return out


def short(problem: str, url: str) -> str:
    """A read's failure without what the row already says (its URL, the errno)."""
    for prefix in (url.rstrip("/") + "/metrics: ", url.rstrip("/") + ": "):
        problem = problem.removeprefix(prefix)
    return re.sub(r"^\[Errno \d+\] ", "", problem)


def _queues(up: list[FleetRow]) -> list[Finding]:
    waits = [r.waiting for r in up if r.waiting is not None]
    if len(waits) < 2:
        return []
    median = statistics.median(waits)
    idle = [r.name for r in up if r.waiting == 0]
    out = []
    for r in up:
        w = r.waiting
        if w is not None and idle and w >= QUEUE_MIN and w >= QUEUE_FACTOR * max(median, 1):
            out.append(Finding(
                "queue_imbalance", r.name, "warning",
                f"{r.name} has {w} waiting (fleet median {median:g}) while "
                f"{', '.join(idle[:3])} {'has' if len(idle) == 1 else 'have'} none: "
                "check the router", {"waiting": w, "median": median, "idle": idle}))
    return out


def _ttft(up: list[FleetRow]) -> list[Finding]:
    known = [(r, r.ttft_p99.value) for r in up if r.ttft_p99.value is not None]
    if len(known) < 2:
        return []
    out = []
    for r, v in known:
        others = [x for o, x in known if o is not r and x is not None]
        median = statistics.median(others)
        if v is not None and v >= TTFT_MIN_S and v >= TTFT_FACTOR * max(median, 1e-3):
            out.append(Finding(
                "ttft_imbalance", r.name, "warning",
                f"{r.name} TTFT p99 {v:.2f}s, {v / max(median, 1e-3):.0f}x the others' median "
                f"{median:.2f}s", {"ttft_p99_s": v, "others_median_s": median}))
    return out


def _kv(up: list[FleetRow]) -> list[Finding]:
    known = [r for r in up if r.kv_usage is not None]
    if len(known) < 2:
        return []
    hi = max(known, key=lambda r: r.kv_usage or 0.0)
    lo = min(known, key=lambda r: r.kv_usage or 0.0)
    if (hi.kv_usage or 0.0) - (lo.kv_usage or 0.0) < KV_SKEW:
        return []
    return [Finding("kv_skew", hi.name, "warning",
                    f"KV use {hi.kv_usage:.0%} on {hi.name} against {lo.kv_usage:.0%} on "
                    f"{lo.name}", {"max": hi.kv_usage, "max_engine": hi.name,
                                   "min": lo.kv_usage, "min_engine": lo.name})]


class FleetAlerts:
    """Findings as alerts (the Alerts screen): each one raised when it first appears (its level,
    message and evidence), and an ``ok`` when it goes away, keyed by (engine, rule)."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, str], Finding] = {}
        self.checked = 0.0

    def update(self, fleet: Fleet, state: ConsoleState) -> None:
        """At most once a second (the app's timer): what changed, as alerts in ``state``."""
        now = state.now()
        if now - self.checked < 1.0:
            return
        self.checked = now
        with state.lock:
            rows = fleet.rows(state, now)
        found = findings(rows, now)
        with state.lock:
            state.fleet_findings = [f.json() for f in found]
        for f, raised in self.changes(found):
            evidence = ", ".join(f"{k} {v}" for k, v in f.evidence.items())
            state.note_alert(Alert(
                now, f.engine, 0, f"fleet {f.rule}", f.level if raised else "ok", None, None,
                f"{f.message} ({evidence})" if raised else f"{f.message}: cleared"))

    def changes(self, found: Sequence[Finding]) -> list[tuple[Finding, bool]]:
        """(finding, raised) for what changed since the last call (raised False: cleared)."""
        now = {(f.engine, f.rule): f for f in found}
        out = [(f, True) for k, f in now.items()
               if k not in self.active or self.active[k].level != f.level]
        out += [(f, False) for k, f in self.active.items() if k not in now]
        self.active = now
        return out
