"""The Fleet screen's rows and ``top --once --json``'s document from a `PrometheusSource`'s last
`Reading`: the same `FleetRow` / `FleetAggregate` as a fleet of scraped targets, so the screen,
the filter, the imbalance rules and the JSON are the fleet's own.

One row per ``(instance, engine)`` Prometheus holds series of (named by the instance, and
``/engine`` where an instance has several ranks). States: ``up`` (Prometheus's ``up`` is 1),
``down`` (its last scrape of the instance failed: dashes, as any down row), and ``stale`` for
every row while Prometheus itself cannot be read (the last figures kept; the banner says why).
A row seen once stays: an engine that Prometheus stopped seeing is ``down``, not gone.
Percentiles: the value is Prometheus's ``histogram_quantile``; the bucket rates decide when it
is known only as a range (`vconsole.console.sources.fleet.merge.percentile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vconsole.console.sources.fleet.imbalance import findings
from vconsole.console.sources.fleet.merge import NONE, Hist, Percentile, percentile
from vconsole.console.sources.fleet.prometheus_query import PrometheusSource, Reading, RowKey
from vconsole.console.sources.fleet.rows import FleetAggregate, FleetRow, _mean, _sum, _sum_int
from vconsole.console.sources.fleet.targets import Target
from vconsole.console.state import ConsoleState


class PrometheusFleet:
    """What the Fleet screen asks of a fleet (`vconsole.console.sources.fleet.rows.Fleet`'s
    ``rows``, ``aggregate``, ``sources``, ``targets``), answered from Prometheus."""

    opens_first = True       # the Fleet screen first, however many rows there are yet
    drill_note = ("read from Prometheus: no drill-in (attach to the engine itself, "
                  "--target KIND=URL, for its screens)")

    def __init__(self, source: PrometheusSource, *, started: float = 0.0) -> None:
        self.source = source
        self.sources = [source]
        self.started = started
        self.window_s = 60.0
        self._seen: dict[RowKey, FleetRow] = {}
        self._state: dict[RowKey, tuple[str, float]] = {}
        self._built: tuple[Any, ...] | None = None
        self._rows: list[FleetRow] = []

    @property
    def targets(self) -> list[Target]:
        """None that takes config changes: the fleet seen through Prometheus is watched only."""
        return []

    def rows(self, state: ConsoleState | None, now: float) -> list[FleetRow]:
        src = self.source
        basis = (src.received, src.problem is None, int(now))
        if basis == self._built:
            return self._rows
        reading = src.reading
        if reading is not None:
            live = src.problem is None
            for key in sorted(set(reading.kinds) | set(self._seen)):
                self._seen[key] = self._row(key, reading, live, now)
        self._rows = [self._seen[k] for k in sorted(self._seen)]
        self._built = basis
        return self._rows

    def _name(self, key: RowKey) -> str:
        ranks = {e for i, e in set(self._seen) | set(self._reading_keys()) if i == key[0]}
        return key[0] if len(ranks) <= 1 or not key[1] else f"{key[0]}/{key[1]}"

    def _reading_keys(self) -> list[RowKey]:
        r = self.source.reading
        return list(r.kinds) if r is not None else []

    def _status(self, key: RowKey, reading: Reading, live: bool) -> str:
        if not live:
            return "stale"
        if key not in reading.kinds or reading.up.get(key[0], 1.0) < 1.0:
            return "down"
        return "up"

    def _since(self, key: RowKey, status: str, now: float) -> float:
        prev = self._state.get(key)
        if prev is not None and prev[0] == status:
            return prev[1]
        since = self.started if prev is None else now
        self._state[key] = (status, since)
        return since

    def _row(self, key: RowKey, reading: Reading, live: bool, now: float) -> FleetRow:
        status = self._status(key, reading, live)
        old = self._seen.get(key)
        if status == "stale" and old is not None:
            old.state, old.since = status, self._since(key, status, now)
            old.problem = "Prometheus unreachable"     # (not the engine: its findings say so)
            return old
        kind = reading.kinds.get(key) or (old.kind if old else "unknown")
        row = FleetRow(self._name(key), kind, f"{self.source.url} instance={key[0]}"
                       + (f" engine={key[1]}" if key[1] else ""), status,
                       self._since(key, status, now),
                       model=reading.models.get(key) or (old.model if old else None),
                       labels={"instance": key[0], **({"engine": key[1]} if key[1] else {})},
                       readonly=True)
        if status != "up":
            row.problem = "Prometheus's scrape of it fails (up 0)" \
                if reading.up.get(key[0], 1.0) < 1.0 else "Prometheus holds no series of it now"
            return row
        f = reading.figures

        def get(name: str) -> float | None:
            return f.get(name, {}).get(key)
        row.running = _int(get("running"))
        row.waiting = _int(get("waiting"))
        row.kv_usage = get("kv_usage")
        row.gen_tok_s = get("gen_tok_s")
        row.preemptions_per_min = get("preemptions_per_min")
        row.prefix_hit = get("prefix_hit")
        row.window = {fig: hist(b) for fig, rows in reading.buckets.items()
                      if (b := rows.get(key))}
        row.ttft_p50 = _pct(get("ttft_s@0.5"), 0.5, row.window.get("ttft_s"))
        row.ttft_p99 = _pct(get("ttft_s@0.99"), 0.99, row.window.get("ttft_s"))
        row.itl_p99 = _pct(get("itl_s@0.99"), 0.99, row.window.get("itl_s"))
        return row

    def aggregate(self, rows: Sequence[FleetRow]) -> FleetAggregate:
        """Sums over the rows that are up; the percentiles are Prometheus's, of the bucket
        rates summed across every engine ``by (le)`` (`promql.fleet_quantile`)."""
        up = [r for r in rows if r.state == "up"]
        reading = self.source.reading if self.source.problem is None else None

        def fleet_pct(figure: str, q: float) -> Percentile:
            if reading is None:
                return NONE
            les = set(reading.fleet_les.get(figure) or ())
            summed = _summed([r.window[figure] for r in up if figure in r.window], les)
            return _pct(reading.fleet.get(f"{figure}@{q:g}"), q, summed)
        return FleetAggregate(
            engines=len(rows), engines_up=len(up),
            running=_sum_int(r.running for r in up), waiting=_sum_int(r.waiting for r in up),
            gen_tok_s=_sum(r.gen_tok_s for r in up),
            ttft_p50=fleet_pct("ttft_s", 0.5), ttft_p99=fleet_pct("ttft_s", 0.99),
            itl_p99=fleet_pct("itl_s", 0.99),
            kv_usage=_mean([r.kv_usage for r in up]))

    def document(self, now: float) -> dict[str, Any]:
        """``top --once --json``'s document (`vconsole.console.sources.fleet.snapshot`)."""
        rows = self.rows(None, now)
        return {"engines": [r.json() for r in rows], "aggregate": self.aggregate(rows).json(),
                "imbalance": [x.json() for x in findings(rows, now)]}


def hist(buckets: list[tuple[str, float]]) -> Hist:
    """A row's bucket rates as the fleet's histogram form (cumulative, ``+Inf`` last)."""
    bounds = [b for b, _ in buckets]
    counts = [c for _, c in buckets]
    return {"bounds": bounds, "counts": counts, "count": counts[-1] if counts else 0.0,
            "sum": 0.0}


def _summed(hists: list[Hist], les: set[str]) -> Hist | None:
    """The rows' bucket rates summed at the bounds merged (all of them when ``les`` is empty)."""
    if not hists:
        return None
    keep = [b for b in hists[0]["bounds"] if not les or b in les]
    tables = [dict(zip(h["bounds"], h["counts"], strict=True)) for h in hists]
    counts = [sum(t.get(b, 0.0) for t in tables) for b in keep]
    return {"bounds": keep, "counts": counts, "count": counts[-1] if counts else 0.0, "sum": 0.0}


def _pct(value: float | None, q: float, h: Hist | None) -> Percentile:
    """Prometheus's ``value``, shown as a range where the bucket rates say it is only one."""
    if value is None:
        return NONE
    if h is None or not h["counts"]:
        return Percentile(value)
    bounds = [math.inf if b in ("+Inf", math.inf) else float(b) for b in h["bounds"]]
    local = percentile(q, bounds, [float(c) for c in h["counts"]])
    return Percentile(value, local.bound)


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))
