"""The fleet's rows: one `FleetRow` per target, whatever its kind, and the fleet's own row.

`Fleet` reads the one `ConsoleState` every target's source feeds (under the target's name) and
what each source knows of its own reads (``problem``, ``starting``), and keeps, per target, a
short history of its counters and latency histograms by **receive time**, so:

- rates (generation tok/s, preemptions a minute) are counter deltas over the last
  `RATE_WINDOW_S`; a counter that went down (a restart) restarts the history: never a
  negative rate;
- TTFT / ITL percentiles are over the last ``window_s`` (0: since each server started) from
  bucket deltas, and the fleet's are percentiles of the bucket counts summed across targets
  over that same window (`vconsole.console.sources.fleet.merge`).

States (with how long, ``since``): ``starting`` (nothing heard yet, or llama.cpp loading),
``up`` (heard within `STALE_AFTER_S` or 2.5 heartbeat intervals), ``stale`` (then, until
`DOWN_AFTER_S`), ``down`` (after that; or never heard and its reads fail).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vconsole.console.engine_state import EngineState
from vconsole.console.sources.fleet.merge import NONE, Hist, Percentile, merge, merged_percentile
from vconsole.console.sources.fleet.merge import window as hist_window
from vconsole.console.sources.fleet.targets import Target
from vconsole.console.state import ConsoleState

STALE_AFTER_S = 2.5
DOWN_AFTER_S = 4.0
RATE_WINDOW_S = 10.0
WINDOW_S = 60.0
SERIES = ("ttft_s", "itl_s")
STATES = ("up", "starting", "stale", "down")


class TargetSource(Protocol):
    """What the rows ask of a target's source (`vconsole.console.sources.fleet.sources`)."""

    @property
    def target(self) -> Target: ...

    @property
    def problem(self) -> str | None: ...

    @property
    def starting(self) -> bool: ...

    @property
    def engine_keys(self) -> Any: ...


@dataclass
class _Point:
    t: float
    gen: float | None
    preempt: float | None
    hists: dict[str, Hist]


@dataclass
class FleetRow:
    name: str
    kind: str
    url: str
    state: str
    since: float
    model: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    kv_usage_estimated: bool = False
    kv_capacity_tokens: int | None = None     # its ranks' KV capacity (None: not said)
    gen_tok_s: float | None = None
    ttft_p50: Percentile = NONE
    ttft_p99: Percentile = NONE
    itl_p99: Percentile = NONE
    prefix_hit: float | None = None
    preemptions_per_min: float | None = None
    alerts: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    readonly: bool = True
    engine_key: str | None = None
    window: dict[str, Hist] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        """The row as ``vconsole top --once --json`` prints it (None where unknown)."""
        return {"name": self.name, "kind": self.kind, "url": self.url, "state": self.state,
                "model": self.model, "running": self.running, "waiting": self.waiting,
                "kv_usage": self.kv_usage, "kv_usage_estimated": self.kv_usage_estimated,
                "gen_tok_s": self.gen_tok_s, "ttft_p50_s": self.ttft_p50.value,
                "ttft_p99_s": self.ttft_p99.value, "itl_p99_s": self.itl_p99.value,
                "prefix_hit": self.prefix_hit,
                "preemptions_per_min": self.preemptions_per_min}


@dataclass
class FleetAggregate:
    engines: int
    engines_up: int
    running: int | None
    waiting: int | None
    gen_tok_s: float | None
    ttft_p50: Percentile
    ttft_p99: Percentile
    itl_p99: Percentile
    kv_usage: float | None

    def json(self) -> dict[str, Any]:
        return {"engines_up": self.engines_up, "running": self.running,
                "waiting": self.waiting, "gen_tok_s": self.gen_tok_s,
                "ttft_p99_s": self.ttft_p99.value, "itl_p99_s": self.itl_p99.value}


class Fleet:
    """See the module docstring. ``sources``: one per target, in the targets' order."""

    def __init__(self, sources: Sequence[TargetSource], *, window_s: float = WINDOW_S,
                 started: float = 0.0) -> None:
        self.sources = list(sources)
        self.window_s = window_s
        self.started = started
        self._history: dict[str, deque[_Point]] = {}
        self._state: dict[str, tuple[str, float]] = {}
        # name -> (what the row was built from, the row): a refresh rebuilds only the rows
        # of targets that sent something since (or changed state, or a new alert came).
        self._built: dict[str, tuple[tuple[Any, ...], FleetRow]] = {}

    @property
    def targets(self) -> list[Target]:
        return [s.target for s in self.sources]

    def rows(self, state: ConsoleState, now: float) -> list[FleetRow]:
        with state.lock:
            return [self._row(src, state, now) for src in self.sources]

    # --- one target ----------------------------------------------------------------------------

    def _engines(self, src: TargetSource, state: ConsoleState) -> list[EngineState]:
        keys = sorted(k for k in list(src.engine_keys) if k in state.engines)
        return [state.engines[k] for k in keys]

    def _status(self, src: TargetSource, engines: list[EngineState], now: float) -> str:
        beats = [e.last_heartbeat for e in engines if e.last_heartbeat is not None]
        if src.starting:
            return "starting"
        if not beats:
            failing = src.problem is not None or now - self.started > DOWN_AFTER_S
            return "down" if failing else "starting"
        interval = max(e.heartbeat_interval for e in engines)
        age = now - max(beats)
        if age <= max(STALE_AFTER_S, 2.5 * interval):
            return "up"
        return "stale" if age <= max(DOWN_AFTER_S, 4.0 * interval) else "down"

    def _since(self, name: str, status: str, now: float) -> float:
        prev = self._state.get(name)
        if prev is not None and prev[0] == status:
            return prev[1]
        since = self.started if prev is None else now
        self._state[name] = (status, since)
        return since

    def _row(self, src: TargetSource, state: ConsoleState, now: float) -> FleetRow:
        t = src.target
        engines = self._engines(src, state)
        status = self._status(src, engines, now)
        since = self._since(t.name, status, now)
        basis = (status, since, src.problem, state.alerts_seen, state.messages if not engines
                 else tuple(e.recv_ts.get("sched", 0.0) for e in engines),
                 tuple(e.recv_ts.get("health", 0.0) for e in engines),
                 getattr(src, "model", None))
        built = self._built.get(t.name)
        if built is not None and built[0] == basis:
            return built[1]
        row = self._build(src, state, engines, status, since)
        self._built[t.name] = (basis, row)
        return row

    def _build(self, src: TargetSource, state: ConsoleState, engines: list[EngineState],
               status: str, since: float) -> FleetRow:
        t = src.target
        row = FleetRow(t.name, t.kind, t.url, status, since,
                       labels=dict(t.labels), problem=src.problem, readonly=t.readonly,
                       engine_key=engines[0].key if engines else None)
        if not engines:
            return row
        bodies = [e.live_bodies() for e in engines]
        row.model = _model(bodies) or getattr(src, "model", None) or None
        if status == "down":
            return row        # its last figures are not live: dashes, as the Ranks screen
        scheds = [b["sched"] for b in bodies if "sched" in b]
        row.running = _sum_int(s.get("num_running") for s in scheds)
        row.waiting = _sum_int(s.get("num_waiting") for s in scheds)
        kvs = [b["kv"] for b in bodies if "kv" in b]
        row.kv_usage = _kv_usage(kvs)
        row.kv_usage_estimated = any(bool(k.get("usage_estimated")) for k in kvs)
        caps = [c for k in kvs if isinstance(c := k.get("capacity_tokens"), int | float) and c > 0]
        row.kv_capacity_tokens = int(sum(caps)) if caps and len(caps) == len(kvs) else None
        hit = [k.get("prefix_hit_rate") for k in kvs if k.get("prefix_queries")]
        row.prefix_hit = _mean(hit)
        row.alerts = sorted({name for e in engines for name in state.alerts_active(e)})
        self._note(t.name, engines, bodies)
        self._rates(row, t.name)
        self._latency(row, t.name)
        return row

    def _note(self, name: str, engines: list[EngineState], bodies: list[dict[str, Any]]) -> None:
        """One history point per new ``sched`` (by its receive time)."""
        t = max((e.recv_ts.get("sched", 0.0) for e in engines), default=0.0)
        hist = self._history.setdefault(name, deque())
        if not t or (hist and hist[-1].t >= t):
            return
        scheds = [b.get("sched", {}) for b in bodies]
        gen = _sum(s.get("num_generation_tokens_total") for s in scheds)
        pre = _sum(s.get("num_preemptions_total") for s in scheds)
        hists = _ranks_hists(bodies)
        point = _Point(t, gen, pre, hists)
        if hist and _went_down(hist[-1], point):
            hist.clear()
        hist.append(point)
        keep = max(self.window_s, RATE_WINDOW_S)
        while len(hist) > 2 and hist[1].t <= t - keep:
            hist.popleft()

    def _rates(self, row: FleetRow, name: str) -> None:
        hist = self._history.get(name)
        if not hist or len(hist) < 2:
            return
        last = hist[-1]
        first = next((p for p in hist if p.t >= last.t - RATE_WINDOW_S), hist[0])
        if first is last:
            first = hist[-2]
        dt = last.t - first.t
        if dt <= 0:
            return
        if last.gen is not None and first.gen is not None:
            row.gen_tok_s = (last.gen - first.gen) / dt
        if last.preempt is not None and first.preempt is not None:
            row.preemptions_per_min = (last.preempt - first.preempt) / dt * 60.0

    def window_hists(self, name: str) -> dict[str, Hist]:
        """The target's histograms over the fleet's window (0: since it started)."""
        hist = self._history.get(name)
        if not hist:
            return {}
        last = hist[-1]
        then = None
        if self.window_s > 0 and len(hist) > 1:
            then = next((p for p in hist if p.t >= last.t - self.window_s), hist[0])
            then = None if then is last else then
        return {s: hist_window(h, then.hists.get(s) if then else None)
                for s, h in last.hists.items()}

    def _latency(self, row: FleetRow, name: str) -> None:
        row.window = self.window_hists(name)
        if "ttft_s" in row.window:
            row.ttft_p50 = merged_percentile(0.5, [row.window["ttft_s"]])
            row.ttft_p99 = merged_percentile(0.99, [row.window["ttft_s"]])
        if "itl_s" in row.window:
            row.itl_p99 = merged_percentile(0.99, [row.window["itl_s"]])

    # --- the fleet -----------------------------------------------------------------------------

    @staticmethod
    def aggregate(rows: Sequence[FleetRow]) -> FleetAggregate:
        """Sums over the targets that are up; percentiles of their summed window buckets."""
        up = [r for r in rows if r.state == "up"]
        ttft = [r.window["ttft_s"] for r in up if "ttft_s" in r.window]
        itl = [r.window["itl_s"] for r in up if "itl_s" in r.window]
        return FleetAggregate(
            engines=len(rows), engines_up=len(up),
            running=_sum_int(r.running for r in up), waiting=_sum_int(r.waiting for r in up),
            gen_tok_s=_sum(r.gen_tok_s for r in up),
            ttft_p50=merged_percentile(0.5, ttft) if ttft else NONE,
            ttft_p99=merged_percentile(0.99, ttft) if ttft else NONE,
            itl_p99=merged_percentile(0.99, itl) if itl else NONE,
            kv_usage=fleet_kv_usage(up))


def fleet_kv_usage(rows: Sequence[FleetRow]) -> float | None:
    """The fleet's KV use: weighted by each target's capacity in tokens when every target
    with a use says its capacity (the share of the fleet's KV tokens in use), else the plain
    mean of the targets' uses."""
    known = [r for r in rows if isinstance(r.kv_usage, int | float)]
    if known and all(r.kv_capacity_tokens for r in known):
        total = sum(r.kv_capacity_tokens or 0 for r in known)
        return sum((r.kv_usage or 0.0) * (r.kv_capacity_tokens or 0) for r in known) / total
    return _mean([r.kv_usage for r in known])


def _went_down(prev: _Point, now: _Point) -> bool:
    if prev.gen is not None and now.gen is not None and now.gen < prev.gen:
        return True
    if prev.preempt is not None and now.preempt is not None and now.preempt < prev.preempt:
        return True
    return any(s in now.hists and now.hists[s]["count"] < h["count"]
               for s, h in prev.hists.items())


def _ranks_hists(bodies: list[dict[str, Any]]) -> dict[str, Hist]:
    """The server's histograms: its ranks' summed (one server's ranks share their bounds); a
    series some rank lacks is left out rather than counted in part."""
    overall = [b.get("latency", {}).get("overall", {}).get("histograms", {}) for b in bodies]
    out: dict[str, Hist] = {}
    for s in SERIES:
        hs = [o[s] for o in overall if isinstance(o.get(s), dict)]
        if not hs or len(hs) < len(bodies):
            continue
        if len(hs) == 1:
            out[s] = hs[0]
            continue
        bounds, counts = merge(hs)
        out[s] = {"bounds": ["+Inf" if b == math.inf else b for b in bounds], "counts": counts,
                  "count": sum(h["count"] for h in hs), "sum": sum(h["sum"] for h in hs)}
    return out


def _model(bodies: list[dict[str, Any]]) -> str | None:
    for b in bodies:
        m = b.get("health", {}).get("model")
        if isinstance(m, str) and m:
            return m
        values = b.get("config", {}).get("values")
        if isinstance(values, dict) and isinstance(values.get("model"), str):
            return str(values["model"])
    return None


def _kv_usage(kvs: list[dict[str, Any]]) -> float | None:
    """Use weighted by capacity (tokens, else blocks) across a target's ranks."""
    pairs = [(k["usage"], k.get("capacity_tokens") or k.get("num_blocks") or 1) for k in kvs
             if isinstance(k.get("usage"), int | float)]
    total = sum(w for _, w in pairs)
    return sum(u * w for u, w in pairs) / total if pairs and total else None


def _sum(values: Any) -> float | None:
    vals = [float(v) for v in values if isinstance(v, int | float)]
    return sum(vals) if vals else None


def _sum_int(values: Any) -> int | None:
    s = _sum(values)
    return int(s) if s is not None else None


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, int | float)]
    return sum(vals) / len(vals) if vals else None
