"""`vconsole top`: the telemetry stream as one JSON snapshot (``--once --json``) or a status line
a second, for scripts and for checking an engine without the console.

``--once`` waits until every topic but ``alert`` (which may never come) has been seen. Config is
announced only every ``config_interval_s``, so if it has not arrived after a short grace the
control socket is asked instead (`ControlClient`). The KV block-state array is summarised (counts
per state and, when short, a run-length list) rather than dumped.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import zmq

from vconsole.engine.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from vconsole.telemetry.control import ControlClient, ControlError
from vconsole.telemetry.curve import ClientCurve
from vconsole.telemetry.schema import DP_TOPICS, TOPICS, SchemaError, TelemetryMessage, decode

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
    if msg.topic == "kv" and "block_states" in body:
        body["block_states"] = summarise_blocks(msg.block_states())
    return body


class Watcher:
    def __init__(self, endpoint: str, ctx: zmq.Context, curve: ClientCurve | None = None) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.subscribe(b"")
        self.sock.connect(endpoint)
        self.latest: dict[str, TelemetryMessage] = {}
        self.bad = 0

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
                        print(f"vconsole top: skipping a bad message: {e}", file=sys.stderr)
                    continue
                self.latest[msg.topic] = msg
            if time.monotonic() >= deadline:
                return

    def close(self) -> None:
        self.sock.close(0)


def _control_config(endpoint: str, timeout_s: float,
                    curve: ClientCurve | None = None) -> dict[str, Any] | None:
    try:
        with ControlClient(endpoint, timeout_s=max(0.2, timeout_s), curve=curve) as client:
            reply = client.get_config()
    except (TimeoutError, ControlError, zmq.ZMQError):
        return None
    return {"version": reply["version"], "values": reply["values"], "schema": reply["schema"],
            "source": "control"}


def snapshot_once(telemetry: str, control: str | None, timeout_s: float,
                  ctx: zmq.Context | None = None, curve: ClientCurve | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """({topic: payload}, missing topics). Config may come from the control socket. ``curve``:
    this client's keys, for an engine started with CURVE keys (both sockets use them)."""
    ctx = ctx or zmq.Context.instance()
    w = Watcher(telemetry, ctx, curve)
    start = time.monotonic()
    deadline = start + timeout_s
    config_body: dict[str, Any] | None = None
    asked = False
    try:
        while True:
            missing = [t for t in WAIT_FOR if t not in w.latest
                       and not (t == "config" and config_body is not None)]
            now = time.monotonic()
            if not missing or now >= deadline:
                break
            if (missing == ["config"] or now - start >= CONFIG_GRACE_S) and \
                    "config" in missing and not asked and control:
                asked = True
                config_body = _control_config(control, min(2.0, deadline - now), curve)
                continue
            w.pump(min(0.1, deadline - now))
    finally:
        w.close()
    out = {t: to_json_payload(m) for t, m in w.latest.items()}
    if "config" not in out and config_body is not None:
        out["config"] = config_body
    out = {t: out[t] for t in TOPICS if t in out}
    return out, missing


def format_line(latest: dict[str, TelemetryMessage]) -> str:
    parts = [time.strftime("%H:%M:%S")]
    if h := latest.get("health"):
        p = h.payload
        parts.append(f"{p['engine']}/{p['rank']} {p['state']} steps={p['steps']}")
        if p.get("alerts_active"):
            parts.append("alerts=" + ",".join(f"{k}:{v}" for k, v in p["alerts_active"].items()))
    if s := latest.get("step"):
        p = s.payload
        parts.append(f"{p['steps_per_s']:.1f} steps/s {p['tokens_per_s']:.0f} tok/s "
                     f"p50={p['step_time_p50_s'] * 1000:.1f}ms")
    if s := latest.get("sched"):
        p = s.payload
        parts.append(f"run={p['num_running']} wait={p['num_waiting']}")
    if k := latest.get("kv"):
        p = k.payload
        parts.append(f"kv={p['usage']:.0%} hit={p['prefix_hit_rate']:.0%}")
    if g := latest.get("gpu"):
        p = g.payload
        if p["available"] and p["devices"]:
            d = p["devices"][0]
            util = "?" if d["util"] is None else f"{d['util']:.0f}%"
            parts.append(f"gpu={util}")
        else:
            parts.append("gpu=n/a")
    if len(parts) == 1:
        parts.append("waiting for telemetry...")
    return "  ".join(parts)


