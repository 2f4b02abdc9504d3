"""KV cache events on the wire in vLLM's format, so KV-aware routers can follow our prefix cache.

The engine's KV cache manager records what enters and leaves the prefix cache
(`vconsole.shared.kv_events`); after each step the busy loop hands that list to
`KVEventPublisher.publish` (a queue put, nothing more). This module's thread encodes and sends
it exactly as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.3x) does:

- **PUB**, one message per step that changed the cache: ``[topic, seq, payload]``. ``topic`` is
  the configured topic (vLLM's default: empty), ``seq`` an 8-byte big-endian counter from 0 that
  grows by one per message, ``payload`` msgpack of an ``EventBatch`` array
  ``[ts, events, data_parallel_rank]``.
- **Events** are tagged maps as msgspec encodes vLLM's ``KVCacheEvent`` structs
  (``tag=True``, ``omit_defaults=True``): ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``,
  ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.
  Fields without a default in vLLM (``lora_id``, ``medium``, ``lora_name``, the parent hash)
  are always present, null when unused; hashes are unsigned 64-bit integers, as vLLM's
  default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``. ``medium`` is where the pool lives: "GPU"
  on CUDA, "CPU" on the CPU.
- **Replay** (optional ROUTER): a client sends the 8-byte big-endian sequence number to start
  from (a DEALER sends ``["", seq]``, a REQ just ``seq``); it gets every kept batch from there
  as ``["", topic, seq, payload]`` and then ``["", "", -1, ""]`` (-1 as 8 signed big-endian
  bytes). The last ``buffer_steps`` batches are kept.

A data-parallel rank ``r`` publishes on the endpoint's port + ``r`` (`offset_endpoint`), as
vLLM. Where the sockets may bind is `vconsole.security.bind_policy`'s call: both are read-only.

The busy loop pays one ``put_nowait``; if the thread cannot keep up and ``max_queue`` batches
wait, a batch is dropped and counted (``dropped``) and the next one queued starts with
``AllBlocksCleared``: a subscriber forgets what it knew rather than trusting a stream with a
hole in it (blocks cached before the hole stay unknown to it until they are stored again). If
the thread dies, `publish` stops queueing (nothing would drain it) and the engine serves on.

Keys: vLLM-format subscribers (routers) speak no CURVE, so these sockets never use it; beyond
loopback they need ``--allow-remote-telemetry`` like the telemetry socket.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from vconsole.security.bind_policy import secure_socket_warning
from vconsole.shared.config import EngineConfig
from vconsole.shared.kv_events import AllBlocksCleared, KVEvent
from vconsole.telemetry.kv_wire import encode_batch, offset_endpoint

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05


class KVEventPublisher:
    """The PUB (and optional replay ROUTER) sockets and the thread that owns them."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None = None, *,
                 topic: str = "", buffer_steps: int = 10_000, dp_rank: int = 0,
                 medium: str = "GPU", hwm: int = 100_000, max_queue: int = 100_000,
                 secure: Callable[[zmq.Socket], None] | None = None) -> None:
        self.topic = topic.encode("utf-8")
        self.dp_rank = dp_rank
        self.medium = medium
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_steps)
        self._lock = threading.Lock()              # the replay buffer: thread vs. `replayed`
        self.seq = 0                               # the next message's sequence number
        self.dropped = 0
        self._lost = False          # a batch was dropped: the next one starts with a clear
        self._dead = False          # the thread stopped: publish does nothing
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            if secure is not None:
                secure(self._pub)
            self._pub.bind(offset_endpoint(endpoint, dp_rank))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole replay must fit: a ROUTER at its high-water mark drops silently.
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
                if secure is not None:
                    secure(self._replay)
                self._replay.bind(offset_endpoint(replay_endpoint, dp_rank))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    # --- the busy loop's side ------------------------------------------------------------------

    def publish(self, events: list[KVEvent], ts: float | None = None) -> None:
        """Queue one step's events (never blocks; a full queue drops and counts)."""
        if not events or self._dead:
            return
        if self._lost:          # a batch was dropped before this one: the cache is unknown
            events = [AllBlocksCleared(), *events]
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, events))
            self._lost = False
        except queue.Full:
            self.dropped += 1
            if not self._lost:
                log.warning("KV event queue full (%d batches): dropping; the next batch "
                            "clears the cache for subscribers", self._queue.maxsize)
            self._lost = True

    def close(self, timeout_s: float = 1.0) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    # --- the kv-events thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                ts, events = item
                self._send(ts, events)
        except Exception:   # the engine serves on without events; say why once
            log.exception("KV event publisher stopped")
        finally:
            self._dead = True   # `publish` stops queueing: nothing would ever drain it
            self._close_sockets()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(ts, events, self.dp_rank, self.medium)
        seq = self.seq
        self.seq += 1
        # A PUB never blocks: at a subscriber's high-water mark it drops, and that subscriber
        # sees the gap in ``seq`` (and may replay it).
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        with self._lock:
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            kept = [(s, p) for s, p in self._buffer if s >= start_seq]
        for seq, payload in kept:
            self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                         payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)


# --- the engine process's use -------------------------------------------------------------

def kv_event_endpoints(config: EngineConfig) -> dict[str, str]:
    """The KV event sockets this engine will bind (its rank's ports), for the bind policy."""
    out = {}
    for name, ep in (("kv_events", config.kv_events_endpoint),
                     ("kv_events_replay", config.kv_events_replay_endpoint)):
        if ep:
            out[name] = offset_endpoint(ep, config.dp_rank)
    return out


def start_kv_events(ctx: zmq.Context, config: EngineConfig, device: str
                     ) -> KVEventPublisher | None:
    """The KV event publisher `--kv-events-endpoint` asks for (None when off). Never CURVE:
    the routers that read vLLM's format cannot; `check_endpoints` kept it on loopback unless
    ``--allow-remote-telemetry``."""
    if not config.kv_events_endpoint:
        return None
    publisher = KVEventPublisher(
        ctx, config.kv_events_endpoint, config.kv_events_replay_endpoint,
        topic=config.kv_events_topic or "", buffer_steps=config.kv_events_buffer_steps,
        dp_rank=config.dp_rank, medium="GPU" if device.startswith("cuda") else "CPU",
        hwm=config.zmq_sndhwm)
    for name, ep in kv_event_endpoints(config).items():
        secure_socket_warning(name, ep)
    return publisher.start()
