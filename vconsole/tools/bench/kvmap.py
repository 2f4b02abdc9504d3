"""`vconsole bench kvmap`: a million-block KV map from the engine's pool to the console's model.

The pool is a real `KVCacheManager` filled through the `BlockPool` API the way serving leaves it:
requests of 4–64 blocks allocated back to back, a fifth sharing their neighbour's first blocks
(shared blocks), half registered in the prefix cache, about a third freed again (cached or plain
free blocks, interleaved with used ones). One round trip is the path a ``kv`` message takes:

  engine   `KVCacheManager.kv_stats()` (the snapshot copy) → publisher `kv_body` →
           `schema.encode` → ``send_multipart(copy=False)`` on a PUB socket,
  wire     ZeroMQ over TCP on 127.0.0.1,
  console  ``recv_multipart(copy=False)`` on a SUB socket → `ConsoleState.ingest` (decode,
           validation, the zero-copy block-state view, the console's per-message bookkeeping),

timed in one thread from the snapshot to the end of ingest; the median over the round trips is
reported, with each phase's median. Wire bytes are the frames' bytes (topic, msgpack payload,
the raw ``uint8`` block-state frame); ZeroMQ adds a few bytes of framing per frame.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import numpy as np
import zmq

from vconsole.console.state import ConsoleState
from vconsole.engine.kv.kv_cache_manager import KVCacheManager
from vconsole.engine.publish.bodies import kv_body
from vconsole.telemetry import schema

BLOCK_SIZE = 16
GOAL_ROUNDTRIP_MS = 5.0
GOAL_WIRE_BYTES = 1_100_000
STATE_NAMES = ("free", "used", "cached", "shared")


def fill_pool(num_blocks: int, seed: int = 0) -> KVCacheManager:
    """A pool in a serving-like state, built only through the `BlockPool` API."""
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, True)
    pool, rng = mgr.pool, random.Random(seed)
    tables: list[list[int]] = []
    while pool.num_free_blocks > 0:
        n = min(rng.randint(4, 64), pool.num_free_blocks)
        blocks = pool.get_new_blocks(n)
        for b in blocks[:-1]:
            pool.set_fill(b, BLOCK_SIZE)
        pool.set_fill(blocks[-1], rng.randint(1, BLOCK_SIZE))
        if rng.random() < 0.5:       # full blocks registered in the prefix cache
            for b in blocks[:-1]:
                pool.cache_full_block(b, hash((seed, b)))
        if tables and rng.random() < 0.2:   # shares its neighbour's first blocks (a prefix hit)
            pool.touch(tables[-1][:4])
        tables.append(blocks)
    for t in tables:
        if t is not tables[0] and rng.random() < 0.35:
            pool.free_blocks(reversed(t))  # as the manager frees: tail first
    return mgr


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return pub, sub


def kvmap_bench(num_blocks: int = 1_000_000, rounds: int = 30,
                log: Any = None) -> dict[str, Any]:
    if log:
        log(f"filling a {num_blocks}-block pool ...")
    mgr = fill_pool(num_blocks)
    states = mgr.pool.block_states
    mix = {name: round(float(np.count_nonzero(states == code)) / num_blocks, 3)
           for code, name in enumerate(STATE_NAMES)}
    console = ConsoleState()
    ctx = zmq.Context()
    pub, sub = _pair(ctx)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    seq = 0

    def roundtrip() -> dict[str, float] | None:
        nonlocal seq
        t0 = time.perf_counter()
        stats = mgr.kv_stats()
        t1 = time.perf_counter()
        payload = {**schema.make_envelope("bench", 0, seq, time.time()), **kv_body(stats)}
        frames = schema.encode("kv", payload)
        t2 = time.perf_counter()
        pub.send_multipart(frames, copy=False)
        seq += 1
        if not poller.poll(1000):
            return None           # not subscribed yet (ZeroMQ's slow joiner)
        got = sub.recv_multipart(copy=False)
        t3 = time.perf_counter()
        msg = console.ingest([f.buffer for f in got], time.time())
        t4 = time.perf_counter()
        if msg is None:
            raise RuntimeError(f"the console rejected the kv message: {console.last_error}")
        wire = sum(memoryview(f).nbytes for f in frames)
        return {"snapshot_ms": (t1 - t0) * 1e3, "encode_ms": (t2 - t1) * 1e3,
                "transfer_ms": (t3 - t2) * 1e3, "ingest_ms": (t4 - t3) * 1e3,
                "roundtrip_ms": (t4 - t0) * 1e3, "wire_bytes": wire}

    try:
        for _ in range(50):
            if roundtrip() is not None:
                break
        else:
            raise RuntimeError("the SUB socket never received a kv message")
        if log:
            log(f"{rounds} round trips ...")
        runs = [r for r in (roundtrip() for _ in range(rounds)) if r is not None]
        if not runs:
            raise RuntimeError("no kv message came through")
        received = console.engines["bench/0"].block_states
        assert received is not None and np.array_equal(received, states), "map corrupted"
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()

    med = {k: round(statistics.median(r[k] for r in runs), 3)
           for k in ("roundtrip_ms", "snapshot_ms", "encode_ms", "transfer_ms", "ingest_ms")}
    wire = int(runs[-1]["wire_bytes"])
    return {
        "benchmark": "kvmap", "num_blocks": num_blocks, "roundtrip_ms": med["roundtrip_ms"],
        "wire_bytes": wire, "rounds": len(runs),
        "roundtrip_ms_max": round(max(r["roundtrip_ms"] for r in runs), 3),
        "phases_ms": {k: v for k, v in med.items() if k != "roundtrip_ms"},
        "state_mix": mix, "raw_bytes": int(states.nbytes),
        "goal": {"roundtrip_ms_max": GOAL_ROUNDTRIP_MS, "wire_bytes_max": GOAL_WIRE_BYTES,
                 "roundtrip_met": med["roundtrip_ms"] < GOAL_ROUNDTRIP_MS,
                 "wire_met": wire <= GOAL_WIRE_BYTES,
                 "met": med["roundtrip_ms"] < GOAL_ROUNDTRIP_MS and wire <= GOAL_WIRE_BYTES},
    }
