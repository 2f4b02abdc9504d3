"""DPFrontEnd: one request endpoint for N data-parallel engine ranks (`vconsole engine -dp N`).

Clients see exactly a lone engine (docs/PROTOCOL.md, "Request protocol"): ``hello`` -> ``ready``
(plus ``data_parallel_size``), ``add``, ``abort``, ``outputs``, ``error`` and heartbeats, which
the front end sends itself every ``client_heartbeat_s``. Behind it, the front end is *one client*
of every rank: a DEALER pair per rank (identity ``dpfe-<pid>``), connected to the rank's private
endpoints. Each new request goes to the least-loaded live rank (`router.choose_rank`) under an id
of the front end's own (`request_map.RequestMap`); outputs and errors are mapped back to the
client and its id.

Threads: **dp-frontend** owns the public input and output ROUTERs, every rank DEALER and the
request map; other threads talk to it only through an inproc PUSH (`rank_up`, `rank_down`,
`close`), so every socket is used by one thread. The telemetry proxy
(`vconsole.engine.dp.front.telemetry_proxy`) and the control fan-out
(`vconsole.engine.dp.front.control_fanout`) run in threads of their own.

Data parallel coordination (only with ranks whose ``ready`` says ``data_parallel_size > 1``):
once every rank is up the front end sends ``{"type": "regroup", "generation": g}`` to each
(g = 0 first, +1 after each rank that came back); a rank's ``{"type": "wave", "event":
"start", "wave": w}`` is forwarded to every other rank as ``{"type": "start_wave", "wave": w}``.

A rank that dies (`rank_down`, from the launcher; with ``liveness``, as under torchrun where
nobody else watches the ranks, also a rank not heard from for ``LIVENESS_INTERVALS`` of its
heartbeat intervals): every request routed to it is finished for its
client with finish_reason ``error`` and an error naming the rank; new requests go to the live
ranks; with none live, a new request is finished at once with an error.

Ranks on other hosts (torchrun, ``rank_curve``): both DEALERs of a link are CURVE clients, and
a rank's ``ready`` carries its ``control_key``; the front end hands it to ``on_ready`` (for the
control fan-out) and keeps it out of everything else, the ``ready`` its own clients get
included. A rank that has not answered ``hello`` within ``HELLO_WARN_S`` is logged once (with
CURVE, a key the rank does not authorise looks exactly like this: silence).

Invariants: every request the front end accepted gets exactly one final output (from its rank,
or from the front end when its rank died or the front end stops); a client can abort only its
own requests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.engine.dp.front.command_channel import CommandChannel
from vconsole.engine.dp.front.rank_link import RankLink, drain
from vconsole.engine.dp.front.request_map import RequestMap, Routed
from vconsole.engine.dp.front.router import choose_rank
from vconsole.security.bind_policy import bind_socket, check_endpoints
from vconsole.wire import protocol
from vconsole.wire.outputs import RequestOutput

if TYPE_CHECKING:
    from vconsole.security.curve import ClientCurve
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

POLL_MS = 50
HELLO_WAIT_S = 5.0
HELLO_WARN_S = 10.0       # a rank silent this long after hello is logged (CURVE keys?)
LIVENESS_INTERVALS = 10
REGROUP, START_WAVE, WAVE = "regroup", "start_wave", "wave"


class DPFrontEnd:
    """See the module docstring. ``public``: the four endpoints clients use (telemetry and
    control are served by the proxy and the fan-out, which the launcher starts alongside).
    ``kv_usage``: rank -> latest KV usage (the telemetry proxy updates it) for tie-breaks."""

    def __init__(self, public: dict[str, str], world_size: int, *, allow_remote: bool = False,
                 curve: ServerCurve | None = None, ctx: zmq.Context | None = None,
                 sndhwm: int = 1000, kv_usage: dict[int, float] | None = None,
                 liveness: bool = True, rank_curve: ClientCurve | None = None,
                 on_ready: Callable[[int, str | None], None] | None = None) -> None:
        """``on_ready(rank, control_key)``: called (dp-frontend thread) when a rank's link
        got its first ``ready``; ``control_key`` is None unless the rank sent one."""
        check_endpoints({n: public[n] for n in ("input", "output")}, allow_remote,
                        curve=curve is not None)
        self.world_size = world_size
        self.liveness = liveness
        self.ctx = ctx or zmq.Context.instance()
        self.curve = curve
        self.rank_curve = rank_curve
        self.on_ready = on_ready
        self.kv_usage = kv_usage if kv_usage is not None else {}
        self.identity = f"dpfe-{os.getpid()}".encode()
        self.endpoints = dict(public)
        self._sockets: dict[str, zmq.Socket] = {}
        for name in ("input", "output"):
            try:
                sock = bind_socket(self.ctx, zmq.ROUTER, name, public[name], curve,
                                   sndhwm=sndhwm)
            except OSError:
                for s in self._sockets.values():
                    s.close(0)
                raise
            self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sockets[name] = sock
        self._sockets["output"].setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._commands = CommandChannel(self.ctx, "dp-frontend")
        self.requests = RequestMap()
        self.links: dict[int, RankLink] = {}
        self.generation = -1
        self._regroup_due = False
        self._clients: set[bytes] = set()            # handshaken: they get heartbeats
        self._hellos: dict[bytes, float] = {}        # client -> give-up time, ready not sent yet
        self.heartbeat_s = 1.0
        self._thread = threading.Thread(target=self._run, name="dp-frontend", daemon=True)

    # --- other threads ---------------------------------------------------------------------

    def start(self) -> DPFrontEnd:
        self._thread.start()
        return self

    def rank_up(self, rank: int, endpoints: dict[str, str]) -> None:
        """Rank ``rank`` serves on ``endpoints`` (again): connect to it and say hello."""
        self._commands.send("up", rank, dict(endpoints))

    def rank_down(self, rank: int, reason: str) -> None:
        """Rank ``rank`` died (``reason``: "killed by SIGKILL"): fail its requests."""
        self._commands.send("down", rank, reason)

    def close(self) -> None:
        """Fail what is in flight ("front end stopped"), close every socket, join the thread."""
        if self._thread.is_alive():
            self._commands.send("close")
            self._thread.join()
        else:
            self._close_sockets()

    # --- the dp-frontend thread --------------------------------------------------------------

    def _run(self) -> None:
        poller = self._commands.poller
        poller.register(self._sockets["input"], zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                commands, ready = self._commands.poll(POLL_MS)
                for cmd in commands:
                    if cmd[0] == "close":
                        self._fail_all("the data-parallel front end stopped")
                        return
                    if cmd[0] == "up":
                        self._connect(poller, cmd[1], cmd[2])
                    else:
                        self._on_rank_down(poller, cmd[1], cmd[2])
                for sock in ready:
                    if sock is self._sockets["input"]:
                        for frames in drain(sock):
                            self._on_client(frames)
                    else:
                        # None: a command just above dropped this rank's link.
                        link = next((lk for lk in self.links.values() if lk.output is sock), None)
                        if link is None:
                            continue
                        for frames in drain(sock):
                            self._on_rank(link, frames)
                now = time.monotonic()
                if self._hellos:
                    self._answer_hellos()
                if now >= next_beat:
                    self._heartbeats()
                    self._check_liveness(poller, now)
                    next_beat = now + self.heartbeat_s
                if self._regroup_due:
                    self._regroup()
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._commands.close()
        for link in self.links.values():
            link.close()
        for sock in self._sockets.values():
            sock.close(0)

    # ranks ------------------------------------------------------------------------------------

    def _connect(self, poller: zmq.Poller, rank: int, endpoints: dict[str, str]) -> None:
        old = self.links.pop(rank, None)
        if old is not None:
            poller.unregister(old.output)
            old.close()
        socks = []
        for name in ("input", "output"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            if self.rank_curve is not None:
                self.rank_curve.apply(sock)
            sock.connect(endpoints[name])
            socks.append(sock)
        link = RankLink(rank, endpoints, socks[0], socks[1])
        self.links[rank] = link
        poller.register(link.output, zmq.POLLIN)
        self._to_rank(link, protocol.encode_hello())

    def _on_rank_down(self, poller: zmq.Poller, rank: int, reason: str) -> None:
        link = self.links.pop(rank, None)
        if link is not None:
            poller.unregister(link.output)
            link.close()
        failed = self.requests.fail_rank(rank)
        log.log(logging.WARNING if failed else logging.INFO,
                "data-parallel rank %d is down (%s): failing its %d request(s)", rank, reason,
                len(failed))
        self._finish(failed, f"data-parallel rank {rank} died: {reason}")

    def _check_liveness(self, poller: zmq.Poller, now: float) -> None:
        for link in self.links.values():
            if not link.up and not link.warned and now - link.last_heard > HELLO_WARN_S:
                link.warned = True
                log.warning("data-parallel rank %d at %s has not answered in %.0f s%s",
                            link.rank, link.endpoints["input"], now - link.last_heard,
                            " (CURVE: is the front end's client key in the rank's "
                            "authorized_clients, and the rank's server.key the one it pins?)"
                            if self.rank_curve is not None else "")
        if not self.liveness:
            return
        for link in list(self.links.values()):
            if link.up and now - link.last_heard > LIVENESS_INTERVALS * self._rank_beat(link):
                self._on_rank_down(poller, link.rank,
                                   f"no heartbeat for {now - link.last_heard:.0f} s")

    @staticmethod
    def _rank_beat(link: RankLink) -> float:
        return float((link.info or {}).get("heartbeat_interval_s") or 1.0)

    def _on_rank(self, link: RankLink, frames: list[bytes]) -> None:
        link.last_heard = time.monotonic()
        try:
            header = protocol.decode(frames)
        except protocol.ProtocolError as e:
            log.warning("rank %d sent an unreadable message: %s", link.rank, e.reason)
            return
        kind = header["type"]
        if kind == protocol.OUTPUTS:
            self._on_outputs(link.rank, header)
        elif kind == protocol.ERROR:
            self._on_error(link.rank, header)
        elif kind == protocol.READY:
            first = link.info is None
            key = header.get("control_key")
            link.info = {k: v for k, v in header.items()
                         if k not in ("v", "type", "control_key")}
            if first and self.on_ready is not None:
                self.on_ready(link.rank, key if isinstance(key, str) and key else None)
            self.heartbeat_s = min(self.heartbeat_s, self._rank_beat(link))
            if first:
                log.info("data-parallel rank %d ready: %s", link.rank, link.endpoints["input"])
                if all(self.links.get(r) is not None and self.links[r].up
                       for r in range(self.world_size)):
                    self._regroup_due = True
        elif kind == WAVE and header.get("event") == "start":
            for other in self.links.values():
                if other.rank != link.rank and other.dp:
                    self._to_rank(other, protocol.encode({"type": START_WAVE,
                                                          "wave": header.get("wave")}))

    def _regroup(self) -> None:
        self._regroup_due = False
        links = [lk for lk in self.links.values() if lk.dp]
        if not links:
            return
        self.generation += 1
        log.info("data-parallel group: regroup generation %d", self.generation)
        for link in links:
            self._to_rank(link, protocol.encode({"type": REGROUP,
                                                 "generation": self.generation}))

    def _on_outputs(self, rank: int, header: dict[str, Any]) -> None:
        try:
            outs = protocol.parse_outputs(header)
        except protocol.ProtocolError as e:
            log.warning("rank %d sent bad outputs: %s", rank, e.reason)
            return
        by_client: dict[bytes, list[RequestOutput]] = {}
        for out in outs:
            entry = (self.requests.pop(rank, out.request_id) if out.finished
                     else self.requests.lookup(rank, out.request_id))
            if entry is None:
                continue
            out.request_id = entry.request_id
            by_client.setdefault(entry.client, []).append(out)
        for client, items in by_client.items():
            self._send(client, protocol.encode_outputs(items))

    def _on_error(self, rank: int, header: dict[str, Any]) -> None:
        rid, in_flight = protocol.request_id_of(header), header.get("in_flight") is True
        entry = (self.requests.lookup(rank, rid) if in_flight else self.requests.pop(rank, rid)) \
            if rid else None
        if entry is None:
            log.warning("rank %d: %s", rank, header.get("reason"))
            return
        self._send(entry.client, protocol.encode_error(str(header.get("reason")),
                                                       entry.request_id, in_flight))

    # clients --------------------------------------------------------------------------------

    def _on_client(self, frames: list[bytes]) -> None:
        client = frames[0]
        try:
            header = protocol.decode(frames[1:])
            kind = header["type"]
            if kind == protocol.HELLO:
                self._hellos[client] = time.monotonic() + HELLO_WAIT_S
            elif kind == protocol.ADD:
                self._add(client, header)
            elif kind == protocol.ABORT:
                self._abort(client, protocol.parse_abort(header))
            else:
                raise protocol.ProtocolError(f"unknown message type {kind!r}",
                                             protocol.request_id_of(header))
        except protocol.ProtocolError as e:
            rid = e.request_id
            if rid is not None and self.requests.of_client(client, rid) is None:
                self._finish_one(client, rid, e.reason)
            else:
                self._send(client, protocol.encode_error(e.reason, rid, rid is not None))

    def _add(self, client: bytes, header: dict[str, Any]) -> None:
        rid = protocol.request_id_of(header)
        if rid is None:
            raise protocol.ProtocolError(
                f"request_id must be a string of 1..{protocol.MAX_REQUEST_ID_LEN} characters")
        live = [r for r, lk in self.links.items() if lk.up]
        rank = choose_rank(live, self.requests.load(live), self.kv_usage)
        if rank is None:
            self._finish_one(client, rid, "no data-parallel rank is serving (all are "
                                          "restarting)")
            return
        entry = self.requests.add(client, rid, rank)
        if entry is None:
            self._send(client, protocol.encode_error(
                f"duplicate request id {rid!r}: one is in flight (it goes on)", rid, True))
            return
        body = {k: v for k, v in header.items() if k != "v"}
        body["request_id"] = entry.fe_id
        if not self._to_rank(self.links[rank], protocol.encode(body)):
            self.requests.pop(rank, entry.fe_id)
            self._finish_one(client, rid, f"data-parallel rank {rank} is not reading its input")

    def _abort(self, client: bytes, request_ids: list[str]) -> None:
        per_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            entry = self.requests.of_client(client, rid)
            if entry is not None:
                per_rank.setdefault(entry.rank, []).append(entry.fe_id)
        for rank, ids in per_rank.items():
            if rank in self.links:
                self._to_rank(self.links[rank], protocol.encode_abort(ids))

    def _ready(self) -> dict[str, Any] | None:
        infos = [lk.info for _, lk in sorted(self.links.items()) if lk.info]
        if not infos:
            return None
        info = {k: v for k, v in infos[0].items() if k != "dp_rank"}
        return {**info, "data_parallel_size": self.world_size,
                "heartbeat_interval_s": self.heartbeat_s}

    def _answer_hellos(self) -> None:
        info = self._ready()
        now = time.monotonic()
        for client, give_up in list(self._hellos.items()):
            if info is None or not self._try_send(client, protocol.encode_ready(info)):
                if now > give_up:
                    del self._hellos[client]
                    log.warning("hello from %s unanswered: %s", client.decode(errors="replace"),
                                "no rank is ready" if info is None else "no output connection")
                continue
            del self._hellos[client]
            self._clients.add(client)

    def _heartbeats(self) -> None:
        frames = protocol.encode_heartbeat("dp-frontend")
        for client in list(self._clients):
            self._send(client, frames)

    def _finish_one(self, client: bytes, request_id: str, error: str) -> None:
        self._send(client, protocol.encode_outputs([RequestOutput(
            request_id, finished=True, finish_reason="error", error=error)]))

    def _finish(self, entries: list[Routed], error: str) -> None:
        by_client: dict[bytes, list[RequestOutput]] = {}
        for e in entries:
            by_client.setdefault(e.client, []).append(RequestOutput(
                e.request_id, finished=True, finish_reason="error", error=error))
        for client, outs in by_client.items():
            self._send(client, protocol.encode_outputs(outs))

    def _fail_all(self, error: str) -> None:
        for rank in list(self.links):
            self._finish(self.requests.fail_rank(rank), error)

    def _try_send(self, client: bytes, frames: protocol.Frames) -> bool:
        try:
            self._sockets["output"].send_multipart([client, *frames], flags=zmq.NOBLOCK,
                                                   copy=False)
            return True
        except zmq.ZMQError:
            return False

    def _send(self, client: bytes, frames: protocol.Frames) -> None:
        """Never blocks: a client without a route, or not reading, is gone: its requests are
        aborted at their ranks."""
        if self._try_send(client, frames):
            return
        self._clients.discard(client)
        gone = self.requests.drop_client(client)
        if gone:
            log.warning("client %s is gone: aborting its %d request(s)",
                        client.decode(errors="replace"), len(gone))
        per_rank: dict[int, list[str]] = {}
        for e in gone:
            per_rank.setdefault(e.rank, []).append(e.fe_id)
        for rank, ids in per_rank.items():
            if rank in self.links:
                self._to_rank(self.links[rank], protocol.encode_abort(ids))

    @staticmethod
    def _to_rank(link: RankLink, frames: protocol.Frames) -> bool:
        """Never blocks: False when the rank's input queue is full (it stopped reading)."""
        try:
            link.input.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
