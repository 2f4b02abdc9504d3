"""TelemetryProxy: every data-parallel rank's telemetry on the one public telemetry endpoint.

A SUB per rank (connected to the rank's private telemetry endpoint, subscribed to everything)
feeds one PUB bound on the public endpoint, with the same bind policy and CURVE as a lone
engine's publisher; messages pass through unchanged (frames as received), so a subscriber tells
ranks apart by the envelope's ``rank``. While a rank is down (`rank_down` .. `rank_up`) the
proxy itself publishes ``health`` with state ``restarting``, that rank's ``rank``, the reason
and the restart count every ``heartbeat_s``, as a lone engine's supervisor does
(`vconsole.engine.publish.beacon`), so a console sees the rank restarting instead of silence.

On the way the proxy keeps the last payload of each (rank, topic) (`bodies_by_rank`: what
Prometheus exports, `vconsole.engine.publish.prometheus.RanksCollector`) and each rank's latest KV
``usage`` (`kv_usage`: the router's tie-break).

Threads: ``dp-telemetry`` owns every socket; `connect` and `close` reach it through an inproc
PUSH. With ``rank_curve`` each SUB is a CURVE client of its rank (ranks on other hosts).
Request text: the ranks publish on private sockets and cannot tell whether the public one may
carry it (`vconsole.security.bind_policy.request_text_refusal`), and a rank can still turn it on
(a reloaded config file). So while ``text_refusal`` is set (the stack's, from the public
endpoint) the proxy takes ``request_text`` out of every ``sched`` payload before it is recorded
or forwarded (`strip_request_text`): the definitive guard, at the public socket itself.

Invariant: a message is forwarded whole or not at all (the PUB drops at its high-water
mark, never blocks), and an undecodable one is still forwarded, just not recorded — except,
while text is refused, a ``sched`` message that may carry text and cannot be decoded: dropped.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from vconsole.engine.dp.front.command_channel import CommandChannel
from vconsole.engine.publish.bodies import health_body
from vconsole.security.bind_policy import bind_socket, check_endpoints
from vconsole.telemetry import schema
from vconsole.telemetry.request_text import FIELD as TEXT_FIELD

if TYPE_CHECKING:
    from vconsole.security.curve import ClientCurve
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

POLL_MS = 100
_SCHED = b"sched"
_TEXT_KEY = TEXT_FIELD.encode()


def strip_request_text(frames: list[Any]) -> list[Any] | None:
    """``frames`` with ``request_text`` taken out of a ``sched`` payload (every other field, and
    the buffer frames, as they were); the same list when it carries none; None when it may
    carry some but cannot be decoded (the caller drops it)."""
    if len(frames) < 2 or bytes(frames[0]) != _SCHED or _TEXT_KEY not in frames[1]:
        return frames
    try:
        payload = msgpack.unpackb(frames[1], raw=False)
        if not isinstance(payload, dict):
            return None
        if payload.pop(TEXT_FIELD, None) is None:
            return frames
        return [frames[0], msgpack.packb(payload, use_bin_type=True), *frames[2:]]
    except Exception:  # msgpack raises several unrelated types for garbage
        return None


class TelemetryProxy:
    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None,
                 curve: ServerCurve | None = None, allow_remote: bool = False,
                 sndhwm: int = 1000, engine_id: str = "engine-0",
                 heartbeat_s: float = 1.0, rank_curve: ClientCurve | None = None,
                 text_refusal: str | None) -> None:
        """``text_refusal``: why ``endpoint`` may not carry request text (None: it may)."""
        self.engine_id = engine_id
        self.text_refusal = text_refusal
        self.stripped = 0        # sched messages whose request text was taken out
        self.rank_curve = rank_curve
        self.heartbeat_s = heartbeat_s
        self._down: dict[int, tuple[str, int]] = {}   # rank -> (reason, restart count)
        self._beacon_seq = 0
        self._t0 = time.monotonic()
        self._t0_wall = time.time()
        check_endpoints({"telemetry": endpoint}, allow_remote, curve=curve is not None)
        self.ctx = ctx or zmq.Context.instance()
        self._pub = bind_socket(self.ctx, zmq.PUB, "telemetry", endpoint, curve, sndhwm=sndhwm)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._commands = CommandChannel(self.ctx, "dp-telemetry")
        self._lock = threading.Lock()
        self._bodies: dict[int, dict[str, dict[str, Any]]] = {}
        self.kv_usage: dict[int, float] = {}      # rank -> usage; read by the front end
        self.forwarded = 0
        self._thread = threading.Thread(target=self._run, name="dp-telemetry", daemon=True)

    def start(self) -> TelemetryProxy:
        self._thread.start()
        return self

    def connect(self, rank: int, endpoint: str) -> None:
        """Listen to ``rank`` at ``endpoint`` (a no-op when already connected there)."""
        self._commands.send("connect", rank, endpoint)

    def rank_down(self, rank: int, reason: str, restart_count: int) -> None:
        """Publish ``restarting`` for ``rank`` until `rank_up`."""
        self._commands.send("down", rank, reason, restart_count)

    def rank_up(self, rank: int) -> None:
        self._commands.send("up", rank)

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.send("close")
            self._thread.join()
        else:
            self._pub.close(0)
            self._commands.close()

    def bodies_by_rank(self) -> dict[int, dict[str, dict[str, Any]]]:
        """``{rank: {topic: last payload}}``: a consistent copy, for one scrape."""
        with self._lock:
            return {r: dict(b) for r, b in self._bodies.items()}

    # --- the dp-telemetry thread -------------------------------------------------------------

    def _run(self) -> None:
        subs: dict[int, tuple[str, zmq.Socket]] = {}
        poller = self._commands.poller
        next_beat = 0.0
        try:
            while True:
                commands, ready = self._commands.poll(POLL_MS)
                for cmd in commands:
                    if cmd[0] == "close":
                        return
                    if cmd[0] == "connect":
                        self._connect(poller, subs, cmd[1], cmd[2])
                    elif cmd[0] == "down":
                        self._down[cmd[1]] = (cmd[2], cmd[3])
                        next_beat = 0.0
                    else:
                        self._down.pop(cmd[1], None)
                for sock in ready:
                    if sock.closed:  # replaced by a "connect" command just above
                        continue
                    frames = self._guard(sock.recv_multipart())
                    if frames is None:
                        continue
                    self._record(frames)
                    try:
                        self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
                        self.forwarded += 1
                    except zmq.Again:
                        pass
                if self._down and time.monotonic() >= next_beat:
                    self._send_restarting()
                    next_beat = time.monotonic() + self.heartbeat_s
        finally:
            for _, sock in subs.values():
                sock.close(0)
            self._pub.close(0)
            self._commands.close()

    def _connect(self, poller: zmq.Poller, subs: dict[int, tuple[str, zmq.Socket]], rank: int,
                 endpoint: str) -> None:
        old = subs.get(rank)
        if old is not None:
            if old[0] == endpoint:
                return
            poller.unregister(old[1])
            old[1].close(0)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.rank_curve is not None:
            self.rank_curve.apply(sock)
        sock.connect(endpoint)
        poller.register(sock, zmq.POLLIN)
        subs[rank] = (endpoint, sock)

    def _guard(self, frames: list[Any]) -> list[Any] | None:
        """What may leave on the public socket of a rank's message (None: nothing)."""
        if self.text_refusal is None:
            return frames
        out = strip_request_text(frames)
        if out is not frames:
            if not self.stripped:
                log.warning("a rank publishes request text; %s It is taken out of every "
                            "sched message here.", self.text_refusal)
            self.stripped += 1
        return out

    def _send_restarting(self) -> None:
        for rank, (reason, count) in self._down.items():
            body = health_body("restarting", uptime_s=time.monotonic() - self._t0, steps=0,
                               interval_s=self.heartbeat_s, started_ts=self._t0_wall,
                               restart_count=count, restart_reason=reason)
            payload = {**schema.make_envelope(self.engine_id, rank, self._beacon_seq,
                                              time.time()), **body}
            self._beacon_seq += 1
            frames = schema.encode("health", payload)
            self._record(frames)
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def _record(self, frames: Sequence[Any]) -> None:
        try:
            msg = schema.decode(frames)
        except schema.SchemaError:
            return
        payload = msg.payload
        if msg.buffers:   # array references point into frames: keep scalars only
            payload = {k: v for k, v in payload.items() if not schema.is_buffer_ref(v)
                       and not isinstance(v, dict)}
        else:
            payload = copy.copy(payload)
        rank = msg.rank
        with self._lock:
            self._bodies.setdefault(rank, {})[msg.topic] = payload
        if msg.topic == "kv" and isinstance(payload.get("usage"), int | float):
            self.kv_usage[rank] = float(payload["usage"])
