"""The publisher process: ``python -m vconsole.engine.publish.publisher_child`` (started by
`vconsole.engine.publish.publisher_process.ChildLink`, its `ChildSpec` on stdin).

It runs what the engine process's publisher thread ran — a `TelemetryPublisher` (its thread,
PUB socket, probes, alerts) and, when asked, ``/metrics`` — fed by the engine's hand-offs from
the hand-off socket instead of by the busy loop directly: its main thread decodes each one
(`handoff_wire`) into the publisher's `Inbox`, exactly the calls the busy loop would have made
in-process. No torch, no model: its imports are the publisher's (zmq, msgpack, numpy, psutil,
prometheus_client).

It lives as long as the engine process: it stops on the engine's ``stop`` (answering
``closed`` with what it sent), and on its parent's death — SIGKILL from the kernel where
``PR_SET_PDEATHSIG`` exists (Linux), else noticed within a poll (`POLL_MS`) by its parent pid
changing. SIGINT, SIGHUP and SIGTERM are ignored — a terminal's, or a launcher's sent to the
engine's whole process group: the engine decides when its publisher stops (after its last
snapshot), and SIGKILL or the engine's death still end it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import time
from typing import Any

import zmq

from vconsole.engine.publish import handoff_wire as wire
from vconsole.engine.publish.host import HostProbe
from vconsole.engine.publish.prometheus import MetricsServer, TelemetryCollector
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.engine.publish.publisher_process import LIVE_FILE, ChildSpec, LiveCounters
from vconsole.engine.publish.queue_mirror import MirroredTable

log = logging.getLogger("vconsole.telemetry.publisher")

POLL_MS = 500                 # how often an idle child checks its parent
STOP_DRAIN_S = 1.0            # at stop, how long the last hand-offs get to go out
RESTART_REPORT_S = 1.0        # a restarted child reports the restart this late (SUB reconnects)
RESYNC_EVERY_S = 1.0          # how often a mirror that lost step asks for the whole queue
PR_SET_PDEATHSIG = 1
# The engine-thread methods a CALL hand-off may name (nothing else is callable from the wire).
CALLS = frozenset({"submit_latency", "submit_kv_residency", "submit_dp", "submit_wave", "report_error", "set_state",
                   "publish_config", "update_config"})


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies (Linux); then make sure it had not died already."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


def _publisher(ctx: zmq.Context, spec: ChildSpec) -> TelemetryPublisher:
    pub = TelemetryPublisher(ctx, spec.endpoint, spec.engine_id, spec.rank, spec.config,
                             host_probe=HostProbe(spec.pid), restart_count=spec.restart_count,
                             restart_reason=spec.restart_reason, kv_format=spec.kv_format,
                             announce_restart=spec.restarted is None)
    pub.pid, pub.t0, pub.t0_wall = spec.pid, spec.t0, spec.t0_wall
    pub.text_decoded = spec.text_decoded
    inbox = pub.inbox
    inbox.announced = spec.announced
    inbox.continue_count(spec.steps_recorded, spec.engine_errors)
    inbox.set_state(spec.state)
    folder = spec.handoff.removeprefix("ipc://").rsplit("/", 1)[0]
    inbox.live = LiveCounters(os.path.join(folder, LIVE_FILE)).read
    return pub


def _failure(e: BaseException) -> dict[str, Any]:
    kind = "zmq" if isinstance(e, zmq.ZMQError) else "os" if isinstance(e, OSError) else "other"
    return {"kind": kind, "errno": getattr(e, "errno", None), "message": str(e)}


class Feed:
    """Applies the engine's hand-offs to one publisher's inbox."""

    def __init__(self, pub: TelemetryPublisher) -> None:
        self.pub = pub
        self.lost = 0

    def steps(self, steps: wire.Steps) -> None:
        inbox = self.pub.inbox
        for record in steps.records:
            stats, end = wire.step_stats(record)
            inbox.record_step(stats, end)
        if steps.lost > self.lost:
            inbox.count_lost(steps.lost - self.lost)
            self.lost = steps.lost

    def apply(self, kind: bytes, body: Any) -> None:
        if kind == wire.SNAPSHOT:
            if body.steps is not None:
                self.steps(body.steps)
            self.pub.inbox.submit_snapshot(body.sched, body.kv, body.state, body.num_steps,
                                           body.text, wall=body.wall)
        elif kind == wire.STEPS:
            self.steps(body)
        elif kind == wire.CALL:
            method, args = body
            if method in CALLS:
                getattr(self.pub, method)(*args)


def serve(link: zmq.Socket, pub: TelemetryPublisher, parent_pid: int,
          restarted: str | None = None, answer: zmq.Socket | None = None) -> None:
    """Until ``stop`` or the parent is gone. ``restarted``: why the previous publisher process
    is gone, reported (``telemetry_error``) once subscribers had time to reconnect."""
    feed = Feed(pub)
    table = MirroredTable()     # the engine's waiting queue, mirrored
    resync_at = time.monotonic() + RESYNC_EVERY_S    # (the first sync is a full one)
    report_at = time.monotonic() + RESTART_REPORT_S
    while True:
        if restarted is not None and time.monotonic() >= report_at:
            pub.report_error("publisher", restarted)
            restarted = None
        if not link.poll(POLL_MS if restarted is None else int(RESTART_REPORT_S * 1000)):
            if os.getppid() != parent_pid:
                log.warning("the engine process %d is gone; the publisher stops", parent_pid)
                return
            continue
        frames = link.recv_multipart(copy=False)
        try:
            kind, body = wire.decode([f.buffer for f in frames], table)
            if kind == wire.STOP:         # the engine's last snapshot goes out first
                deadline = time.monotonic() + STOP_DRAIN_S
                while not pub.inbox.sent_all() and time.monotonic() < deadline:
                    time.sleep(0.01)
                return
            feed.apply(kind, body)
        except Exception as e:       # a bad hand-off costs itself only
            table.reset()             # (it may have half-applied the queue's changes)
            pub.report_error("handoff", f"{type(e).__name__}: {e}")
        if table.wants_full and answer is not None and time.monotonic() >= resync_at:
            with contextlib.suppress(zmq.ZMQError):
                answer.send_multipart(wire.message_frames(wire.RESYNC), flags=zmq.NOBLOCK)
            resync_at = time.monotonic() + RESYNC_EVERY_S


def main() -> int:
    spec: ChildSpec = pickle.loads(sys.stdin.buffer.read())
    _die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    link = ctx.socket(zmq.PULL)
    link.setsockopt(zmq.LINGER, 0)
    link.connect(spec.handoff)
    answer = ctx.socket(zmq.PUSH)
    answer.setsockopt(zmq.LINGER, 2000)
    answer.connect(spec.answers)
    pub = _publisher(ctx, spec)
    metrics: MetricsServer | None = None
    try:
        pub.start()
        if spec.metrics is not None:   # figures = what the publisher last sent
            metrics = MetricsServer(TelemetryCollector(pub, model_name=spec.model_name,
                                                       engine=spec.rank), *spec.metrics).start()
    except Exception as e:
        pub.close()
        answer.send_multipart(wire.message_frames(wire.FAILED, _failure(e)))
        link.close()
        answer.close()
        ctx.term()
        return 2
    answer.send_multipart(wire.message_frames(wire.READY, {
        "endpoint": pub.endpoint, "metrics": metrics.url if metrics else None,
        "metrics_bind": (metrics.host, metrics.port) if metrics else None}))
    try:
        serve(link, pub, spec.parent_pid, spec.restarted, answer)
    finally:
        if metrics is not None:
            metrics.close()
        pub.close()
        with contextlib.suppress(zmq.ZMQError):
            answer.send_multipart(wire.message_frames(wire.CLOSED, {
                "sent": dict(pub.sent), "send_drops": pub.send_drops}), flags=zmq.NOBLOCK)
        link.close()
        answer.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
