"""KV cache events in vLLM's wire form (``vllm/distributed/kv_events.py``): the event maps, the
batch payload, the unsigned hashes and the rank's endpoint rule.

Why here and not beside the publisher: the engine's publisher (`vconsole.engine.publish.kv_events`)
encodes with it and the console's vLLM source finds a rank's endpoint with `offset_endpoint`;
both read one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from vconsole.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

U64 = (1 << 64) - 1


def u64(block_hash: int) -> int:
    """Our pool's signed 64-bit hash as vLLM's unsigned 64-bit block hash."""
    return block_hash & U64


def event_body(ev: KVEvent, medium: str) -> dict[str, Any]:
    """One event as msgspec encodes vLLM's struct of the same name (field order kept)."""
    if isinstance(ev, BlockStored):
        return {"type": "BlockStored", "block_hashes": [u64(h) for h in ev.block_hashes],
                "parent_block_hash": None if ev.parent_block_hash is None
                else u64(ev.parent_block_hash),
                "token_ids": list(ev.token_ids), "block_size": ev.block_size,
                "lora_id": None, "medium": medium, "lora_name": None}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [u64(h) for h in ev.block_hashes],
                "medium": medium}
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def encode_batch(ts: float, events: Sequence[KVEvent], dp_rank: int, medium: str) -> bytes:
    """msgpack of vLLM's ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``."""
    return msgpack.packb([float(ts), [event_body(e, medium) for e in events], dp_rank],
                         use_bin_type=True)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: rank 0 keeps the endpoint; rank r adds r to a tcp port,
    or ``_dp<r>`` to an inproc/ipc name."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"a tcp endpoint needs a port to offset by rank: {endpoint!r}")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
