"""A vLLM server's KV event stream, followed: the prefix cache's contents per rank.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) and our
own engine (``--kv-events-endpoint``) publish ``[topic, seq, payload]`` on a PUB socket, rank r
on the endpoint's port + r (`vconsole.telemetry.kv_wire`). `decode_batch` reads a payload in
every encoding vLLM has used: the batch as an array ``[ts, events(, dp_rank)]`` or a map, each
event a tagged map (``{"type": "BlockStored", ...}``, vLLM ≥ 0.2x) or a positional array
(``["BlockStored", hashes, parent, tokens, block_size, ...]``, older vLLM); hashes as ints or
bytes. `PrefixCacheMirror` replays the events into the set of cached blocks (with each block's
depth in its prefix chain) and counts stores and removals. `KVEventFeed` is the thread that
subscribes: one SUB (and, with a replay endpoint, one DEALER) per rank; a gap in a rank's
sequence numbers is caught up through vLLM's replay protocol before anything newer is applied.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
LONGEST = 5
REPLAY_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class Stored:
    block_hashes: list[Hashable]
    parent: Hashable | None
    block_size: int | None


@dataclass(frozen=True)
class Removed:
    block_hashes: list[Hashable]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _hashes(raw: Any) -> list[Hashable]:
    return [bytes(h) if isinstance(h, bytearray) else h for h in (raw or ())]


def _event(raw: Any) -> Event | None:
    """One event, tagged map or positional array; None for a kind this reader does not know."""
    if isinstance(raw, dict):
        kind, get = raw.get("type"), raw.get
        fields = {"block_hashes": get("block_hashes"), "parent": get("parent_block_hash"),
                  "block_size": get("block_size")}
    elif isinstance(raw, list | tuple) and raw:
        kind = raw[0]
        rest = list(raw[1:]) + [None] * 4
        fields = {"block_hashes": rest[0], "parent": rest[1] if kind == "BlockStored" else None,
                  "block_size": rest[3] if kind == "BlockStored" else None}
    else:
        return None
    if kind == "BlockStored":
        bs = fields["block_size"]
        return Stored(_hashes(fields["block_hashes"]), fields["parent"],
                      bs if isinstance(bs, int) else None)
    if kind == "BlockRemoved":
        return Removed(_hashes(fields["block_hashes"]))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, data_parallel_rank)``; ValueError for a payload that is no event batch."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError("not a KV event batch")
    if not isinstance(ts, int | float) or not isinstance(events, list | tuple):
        raise ValueError("not a KV event batch")
    out = [ev for e in events if (ev := _event(e)) is not None]
    return float(ts), out, rank if isinstance(rank, int) else None


class PrefixCacheMirror:
    """The cached blocks of one rank as its events say, with counts and rates."""

    def __init__(self) -> None:
        self.depth: dict[Hashable, int] = {}      # cached block -> blocks in its prefix chain
        self.block_size: int | None = None
        self.stored_total = 0
        self.removed_total = 0
        self.cleared_total = 0
        self.batches = 0
        self._history: collections.deque[tuple[float, int, int]] = collections.deque()

    def apply(self, events: Sequence[Event], now: float | None = None) -> None:
        for ev in events:
            if isinstance(ev, Stored):
                parent_depth = self.depth.get(ev.parent, 0) if ev.parent is not None else 0
                for i, h in enumerate(ev.block_hashes):
                    self.depth[h] = parent_depth + i + 1
                self.stored_total += len(ev.block_hashes)
                if ev.block_size:
                    self.block_size = ev.block_size
            elif isinstance(ev, Removed):
                for h in ev.block_hashes:
                    self.depth.pop(h, None)
                self.removed_total += len(ev.block_hashes)
            else:
                self.depth.clear()
                self.cleared_total += 1
        self.batches += 1
        self._note(time.time() if now is None else now)

    def _note(self, now: float) -> None:
        h = self._history
        h.append((now, self.stored_total, self.removed_total))
        while len(h) > 2 and h[1][0] <= now - RATE_WINDOW_S:
            h.popleft()

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        stored_s = removed_s = 0.0
        if len(self._history) > 1:
            (t0, s0, r0), (_, s1, r1) = self._history[0], self._history[-1]
            span = max(now - t0, 1e-9)
            stored_s, removed_s = (s1 - s0) / span, (r1 - r0) / span
        cached = len(self.depth)
        longest = heapq.nlargest(LONGEST, self.depth.values())
        return {"cached_blocks": cached, "block_size": self.block_size,
                "stored_total": self.stored_total, "removed_total": self.removed_total,
                "cleared_total": self.cleared_total, "stored_per_s": round(stored_s, 3),
                "removed_per_s": round(removed_s, 3),
                "churn": round(removed_s / cached, 4) if cached else 0.0,
                "longest_prefixes_blocks": longest}


class KVEventFeed:
    """Subscribes to each rank's KV events (rank r on ``endpoint``'s port + r) and keeps a
    `PrefixCacheMirror` per rank; `summary(rank)` is safe from any thread."""

    def __init__(self, endpoint: str, ranks: Sequence[int], *,
                 replay_endpoint: str | None = None, topic: str = "") -> None:
        from vconsole.telemetry.kv_wire import offset_endpoint

        self.endpoints = {r: offset_endpoint(endpoint, r) for r in ranks}
        self.replay_endpoints = ({r: offset_endpoint(replay_endpoint, r) for r in ranks}
                                 if replay_endpoint else {})
        self.topic = topic.encode()
        self.mirrors = {r: PrefixCacheMirror() for r in ranks}
        self.last_seq: dict[int, int] = {}
        self.gaps = 0
        self.replayed = 0
        self.unrecovered = 0        # gaps replay could not fill: the mirror started over
        self.restarts = 0           # the publisher's sequence started over
        self.bad = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)

    def start(self) -> KVEventFeed:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def summary(self, rank: int) -> dict[str, Any] | None:
        with self._lock:
            mirror = self.mirrors.get(rank)
            if mirror is None or not mirror.batches:
                return None
            return {**mirror.summary(), "gaps": self.gaps, "replayed": self.replayed,
                    "unrecovered": self.unrecovered, "restarts": self.restarts}

    # --- the feed's thread ---------------------------------------------------------------------

    def handle(self, rank: int, seq: int, payload: bytes,
               replay: zmq.Socket | None = None) -> None:
        """One published message: a gap is caught up first (through ``replay``), then it is
        applied. A sequence number at or below the last one means the publisher started over
        (the server restarted): what the mirror held is gone with it."""
        last = self.last_seq.get(rank)
        if last is not None and seq <= last:
            self.restarts += 1
            self._apply_events(rank, [Cleared()])
            last = None
        if last is not None and seq > last + 1:
            self.gaps += 1
            got = self._replay(replay, last + 1) if replay is not None else []
            wanted = [(s, p) for s, p in got if last < s < seq]
            if not wanted or wanted[0][0] != last + 1:
                # Not all of the gap is to be had (no replay socket, or its buffer rolled
                # over): the mirror cannot be trusted; start again from what comes now.
                self.unrecovered += 1
                self._apply_events(rank, [Cleared()])
            else:
                for r_seq, r_payload in wanted:
                    self._apply(rank, r_seq, r_payload)
                    self.replayed += 1
        self._apply(rank, seq, payload)

    def _apply(self, rank: int, seq: int, payload: bytes) -> None:
        self.last_seq[rank] = seq       # even when it does not decode: no false gap after it
        try:
            _, events, _ = decode_batch(payload)
        except ValueError:
            self.bad += 1
            return
        self._apply_events(rank, events)

    def _apply_events(self, rank: int, events: list[Event]) -> None:
        with self._lock:
            self.mirrors.setdefault(rank, PrefixCacheMirror()).apply(events)

    @staticmethod
    def _replay(sock: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
        """vLLM's replay: ``start`` in, ``(seq, payload)`` frames out until the empty payload.
        Accepts replies with the topic frame (vLLM 0.33, ours) and without (older vLLM); what
        an earlier, timed-out request left queued is drained first and never taken for this
        one's."""
        while sock.poll(0):
            sock.recv_multipart()
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            seq_frame, payload = frames[-2], frames[-1]
            if not payload:
                break
            seq = int.from_bytes(seq_frame, "big")
            if seq >= start:
                out.append((seq, payload))
        return out

    def _run(self) -> None:
        ctx = zmq.Context()
        subs: dict[zmq.Socket, int] = {}
        replays: dict[int, zmq.Socket] = {}
        try:
            poller = zmq.Poller()
            for rank, ep in self.endpoints.items():
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.subscribe(self.topic)
                sub.connect(ep)
                subs[sub] = rank
                poller.register(sub, zmq.POLLIN)
            for rank, ep in self.replay_endpoints.items():
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.IMMEDIATE, 1)   # no peer: a request is not kept queued
                dealer.connect(ep)
                replays[rank] = dealer
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.bad += 1
                        continue
                    rank = subs[sock]
                    self.handle(rank, int.from_bytes(frames[1], "big"), frames[2],
                                replays.get(rank))
        except Exception:
            log.exception("KV event feed stopped")
        finally:
            for s in [*subs, *replays.values()]:
                s.close(0)
            ctx.term()
