"""`vconsole top`: the telemetry stream as one JSON snapshot (``--once --json``) or a status line
a second, for scripts and for checking an engine without the console.

``--once`` waits until every topic but ``alert`` (which may never come) has been seen. Config is
announced only every ``config_interval_s``, so if it has not arrived after a short grace the
control socket is asked instead (`ControlClient`). The KV block-state array is summarised (counts
per state and, when short, a run-length list) rather than dumped; the ``kv`` payload also says how
the pool stores tokens (``cache_dtype``, ``bytes_per_token``, ``capacity_tokens``,
``pool_bytes``: ``top --once --json | jq .kv.cache_dtype``), and the status line its dtype.

Data parallel (one endpoint carrying every rank's messages, the envelope's ``rank`` apart): once
several ranks are seen, or a ``dp`` message names a group of more than one, the snapshot is
``{"ranks": {"0": {topic: payload}, ...}, "aggregate": {...}}`` (`vconsole.console.ranks`),
and ``--once`` waits for those topics plus ``dp`` from every rank of the group (0 to
``world_size`` - 1); the aggregate adds ``kv_cache_dtype``, ``kv_bytes_per_token``,
``kv_capacity_tokens`` and ``kv_pool_bytes``. One rank and no ``dp``: exactly the lone engine's
``{topic: payload}``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import zmq

from vconsole.console.ranks import aggregate
from vconsole.console.sources.vllm import ScrapeError, VllmScraper
from vconsole.security.curve import ClientCurve
from vconsole.shared.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from vconsole.telemetry.printable import printable
from vconsole.telemetry.request_text import FIELD as TEXT_FIELD
from vconsole.telemetry.request_text import text_of
from vconsole.telemetry.schema import (
    DP_TOPICS,
    TOPICS,
    RequestColumns,
    SchemaError,
    TelemetryMessage,
    decode,
)
from vconsole.wire.control import ControlError
from vconsole.wire.control_client import ControlClient

WAIT_FOR = tuple(t for t in TOPICS if t != "alert" and t not in DP_TOPICS)
CONFIG_GRACE_S = 1.5
MAX_RUNS = 64
_STATE_NAMES = {BLOCK_FREE: "free", BLOCK_USED: "used", BLOCK_CACHED: "cached",
                BLOCK_SHARED: "shared"}


def summarise_blocks(states: np.ndarray) -> dict[str, Any]:
    """Counts per state, plus ``runs`` [[state, length], ...] when there are at most MAX_RUNS."""
    counts = np.bincount(states, minlength=4) if states.size else np.zeros(4, np.int64)
    out: dict[str, Any] = {
        "num_blocks": int(states.size),
        "counts": {_STATE_NAMES.get(i, str(i)): int(c) for i, c in enumerate(counts)},
    }
    if states.size:
        edges = np.flatnonzero(states[1:] != states[:-1]) + 1
        starts = np.concatenate(([0], edges))
        lengths = np.diff(np.concatenate((starts, [states.size])))
        if len(starts) <= MAX_RUNS:
            out["runs"] = [[int(states[s]), int(n)] for s, n in zip(starts, lengths, strict=True)]
        else:
            out["runs"] = None
            out["note"] = f"run-length list omitted: {len(starts)} runs"
    else:
        out["runs"] = []
    return out


def to_json_payload(msg: TelemetryMessage) -> dict[str, Any]:
    """The payload with raw buffer references replaced by something JSON can carry."""
    body = dict(msg.payload)
    if isinstance(body.get("requests"), RequestColumns):   # sched: the rows, as JSON maps
        body["requests"] = with_text(body["requests"].rows(), body.pop(TEXT_FIELD, None))
    if msg.topic == "kv" and "block_states" in body:
        body["block_states"] = summarise_blocks(msg.block_states())
    return body


def with_text(rows: list[dict[str, Any]], text: Any) -> list[dict[str, Any]]:
    """The rows, each with ``prompt_head`` and ``output_tail`` when the engine publishes request
    text (`vconsole.telemetry.request_text`; None for a row it sent none for: beyond the first
    rows); as they are when it does not."""
    if not isinstance(text, dict):
        return rows
    sched = {TEXT_FIELD: text}
    for row in rows:
        t = text_of(sched, str(row.get("id")))
        row["prompt_head"] = t.prompt_head if t else None
        row["output_tail"] = t.output_tail if t else None
    return rows


class Seen:
    """The last message per topic, overall and per rank, of whatever was fed in."""

    def __init__(self) -> None:
        self.latest: dict[str, TelemetryMessage] = {}    # last per topic, any rank
        self.by_rank: dict[int, dict[str, TelemetryMessage]] = {}
        self.bad = 0

    def add(self, msg: TelemetryMessage) -> None:
        self.latest[msg.topic] = msg
        self.by_rank.setdefault(msg.rank, {})[msg.topic] = msg

    def world_size(self) -> int:
        """The data-parallel group's size: the largest ``world_size`` a ``dp`` message named,
        at least the ranks seen (1 for a lone engine)."""
        sizes = [m.payload.get("world_size") for r in self.by_rank.values()
                 if (m := r.get("dp")) is not None]
        return max([len(self.by_rank), *(s for s in sizes if isinstance(s, int))])

    def ranks_expected(self) -> list[int]:
        return sorted(set(range(self.world_size())) | set(self.by_rank))

    def snapshot(self) -> dict[str, Any]:
        """What ``top --json`` prints for what was seen: ``{topic: payload}`` for one rank,
        ``{"ranks": {...}, "aggregate": {...}}`` for a group."""
        if self.world_size() <= 1:
            return {t: to_json_payload(m) for t, m in self.latest.items()}
        return ranks_snapshot({r: {t: to_json_payload(m) for t, m in msgs.items()}
                               for r, msgs in self.by_rank.items()})


class Watcher(Seen):
    """`Seen` fed from a SUB socket on a telemetry endpoint."""

    def __init__(self, endpoint: str, ctx: zmq.Context, curve: ClientCurve | None = None) -> None:
        super().__init__()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.subscribe(b"")
        self.sock.connect(endpoint)

    def pump(self, timeout_s: float) -> None:
        """Receive whatever arrives within ``timeout_s``, keeping the latest per topic."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if not self.sock.poll(max(0, int(left * 1000))):
                return
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg = decode(frames)
                except SchemaError as e:
                    self.bad += 1
                    if self.bad == 1:
                        print(printable(f"vconsole top: skipping a bad message: {e}"), file=sys.stderr)
                    continue
                self.add(msg)
            if time.monotonic() >= deadline:
                return

    def close(self) -> None:
        self.sock.close(0)


class VllmWatcher(Seen):
    """`Seen` fed by scraping a vLLM server's ``/metrics`` (`vconsole.console.sources.vllm`)."""

    def __init__(self, url: str, *, window_s: float = 60.0) -> None:
        super().__init__()
        self.scraper = VllmScraper(url, window_s=window_s)

    def pump(self) -> None:
        """One scrape; `ScrapeError` when it failed or found no ``vllm:*`` series."""
        frames = self.scraper.scrape()
        if not frames:
            raise ScrapeError(f"{self.scraper.url}: no vllm:* series (is this a vLLM server?)")
        for f in frames:
            self.add(decode(f))

    def snapshot(self) -> dict[str, Any]:
        return {"source": {"kind": "vllm", "url": self.scraper.url}, **super().snapshot()}


def snapshot_vllm(url: str, interval_s: float = 1.0) -> dict[str, Any]:
    """``top --once --json --vllm URL``: two scrapes ``interval_s`` apart (the rates need a
    window), then the same topics and keys as for our own engine; the latency percentiles are
    over each histogram since the server started (``window_s`` 0). `ScrapeError` on failure."""
    w = VllmWatcher(url, window_s=0.0)
    w.pump()
    time.sleep(interval_s)
    w.pump()
    return w.snapshot()


def _control_config(endpoint: str, timeout_s: float,
                    curve: ClientCurve | None = None) -> dict[str, Any] | None:
    try:
        with ControlClient(endpoint, timeout_s=max(0.2, timeout_s), curve=curve) as client:
            reply = client.get_config()
    except (TimeoutError, ControlError, zmq.ZMQError):
        return None
    return {"version": reply["version"], "values": reply["values"], "schema": reply["schema"],
            "source": "control"}


def _ordered(bodies: dict[str, Any]) -> dict[str, Any]:
    return {t: bodies[t] for t in TOPICS if t in bodies}


def ranks_snapshot(bodies_by_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``{"ranks": {"<rank>": {topic: payload}}, "aggregate": ranks.aggregate(...)}``."""
    ranks = {str(r): _ordered(bodies_by_rank[r]) for r in sorted(bodies_by_rank)}
    return {"ranks": ranks, "aggregate": aggregate(bodies_by_rank)}


def snapshot_once(telemetry: str, control: str | None, timeout_s: float,
                  ctx: zmq.Context | None = None, curve: ClientCurve | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """({topic: payload}, missing topics). Config may come from the control socket. ``curve``:
    this client's keys, for an engine started with CURVE keys (both sockets use them). A
    data-parallel group: ``({"ranks": ..., "aggregate": ...}, ["rank R: topic", ...])``."""
    ctx = ctx or zmq.Context.instance()
    w = Watcher(telemetry, ctx, curve)
    start = time.monotonic()
    deadline = start + timeout_s
    config_body: dict[str, Any] | None = None
    asked = False
    try:
        while True:
            missing = _missing(w, config_body is not None)
            now = time.monotonic()
            if not missing or now >= deadline:
                break
            need_config = any(m.endswith("config") for m in missing)
            if (all(m.endswith("config") for m in missing) or now - start >= CONFIG_GRACE_S) \
                    and need_config and not asked and control:
                asked = True
                config_body = _control_config(control, min(2.0, deadline - now), curve)
                continue
            w.pump(min(0.1, deadline - now))
    finally:
        w.close()
    if w.world_size() > 1:
        by_rank = {r: {t: to_json_payload(m) for t, m in w.by_rank.get(r, {}).items()}
                   for r in w.ranks_expected()}
        for bodies in by_rank.values():
            if "config" not in bodies and config_body is not None:
                bodies["config"] = config_body
        return ranks_snapshot(by_rank), missing
    out = {t: to_json_payload(m) for t, m in w.latest.items()}
    if "config" not in out and config_body is not None:
        out["config"] = config_body
    return _ordered(out), missing


def _missing(w: Watcher, have_config: bool) -> list[str]:
    """Topics still awaited: ``topic`` for one rank; ``rank R: topic`` (``dp`` included) for
    every rank of a group."""
    if w.world_size() <= 1:
        return [t for t in WAIT_FOR if t not in w.latest
                and not (t == "config" and have_config)]
    return [f"rank {r}: {t}" for r in w.ranks_expected() for t in (*WAIT_FOR, "dp")
            if t not in w.by_rank.get(r, {}) and not (t == "config" and have_config)]


def _n(v: Any, spec: str, scale: float = 1.0) -> str:
    """``v * scale`` formatted, or ``-`` when the source does not have it (None)."""
    return format(v * scale, spec) if isinstance(v, int | float) else "-"


def format_line(latest: dict[str, dict[str, Any]]) -> str:
    """One status line from the last payload of each topic (``{topic: payload}``); what came
    over the wire as text (engine name, state, alert names) has its control characters
    escaped (`printable`), so a name cannot drive the terminal."""
    return printable(_format_line(latest))


def _format_line(latest: dict[str, dict[str, Any]]) -> str:
    parts = [time.strftime("%H:%M:%S")]
    if p := latest.get("health"):
        parts.append(f"{p['engine']}/{p['rank']} {p['state']} steps={p['steps']}")
        if p.get("alerts_active"):
            parts.append("alerts=" + ",".join(f"{k}:{v}" for k, v in p["alerts_active"].items()))
    if p := latest.get("step"):
        parts.append(f"{_n(p.get('steps_per_s'), '.1f')} steps/s "
                     f"{_n(p.get('tokens_per_s'), '.0f')} tok/s "
                     f"p50={_n(p.get('step_time_p50_s'), '.1f', 1000)}ms")
    if p := latest.get("sched"):
        parts.append(f"run={p['num_running']} wait={p['num_waiting']}")
    if p := latest.get("kv"):
        parts.append(f"kv={_n(p.get('usage'), '.0%')} hit={_n(p.get('prefix_hit_rate'), '.0%')}")
        if isinstance(p.get("cache_dtype"), str):
            parts.append(f"kv_dtype={p['cache_dtype']}")
    if p := latest.get("gpu"):
        if p["available"] and p["devices"]:
            d = p["devices"][0]
            util = "?" if d["util"] is None else f"{d['util']:.0f}%"
            parts.append(f"gpu={util}")
        else:
            parts.append("gpu=n/a")
    if len(parts) == 1:
        parts.append("waiting for telemetry...")
    return "  ".join(parts)


def format_ranks_line(w: Watcher) -> str:
    """The status line of a group: the aggregate, then each rank's queues (escaped as
    `format_line`)."""
    return printable(_format_ranks_line(w))


def _format_ranks_line(w: Watcher) -> str:
    bodies = {r: {t: m.payload for t, m in msgs.items()} for r, msgs in w.by_rank.items()}
    agg = aggregate(bodies)
    parts = [time.strftime("%H:%M:%S"), f"{w.world_size()} ranks"]
    if agg["wave"] is not None:
        parts.append(f"wave={agg['wave']}{'+' if agg['wave_running'] else ''}")
    if agg["tokens_per_s"] is not None:
        parts.append(f"{agg['tokens_per_s']:.0f} tok/s")
    if agg["num_running"] is not None:
        parts.append(f"run={agg['num_running']:.0f} wait={agg['num_waiting']:.0f}")
    if agg["kv_usage"] is not None:
        parts.append(f"kv={agg['kv_usage']:.0%}")
    if agg["imbalance"] is not None:
        parts.append(f"imbalance={agg['imbalance']:.2f}" + ("!" if agg["imbalanced"] else ""))
    for r in sorted(bodies):
        sc = bodies[r].get("sched")
        state = bodies[r].get("health", {}).get("state", "?")
        parts.append(f"r{r}:{state}" + (f" {sc['num_running']}/{sc['num_waiting']}" if sc
                                         else ""))
    return "  ".join(parts)
