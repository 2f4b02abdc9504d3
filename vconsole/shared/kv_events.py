"""What enters and leaves the prefix cache, as events (vLLM's ``kv_events`` vocabulary).

The KV cache manager appends these to a list while events are on (`vconsole engine
--kv-events-endpoint`): a run of full blocks registered for one request (`BlockStored`: their
hashes, the hash of the block before them, their tokens), a cached block evicted to be reused
(`BlockRemoved`), or every hash forgotten at once (`AllBlocksCleared`, prefix caching switched
off). Replayed in order they give exactly the set of hashes the pool holds. The engine process
takes the list after each step and hands it to the publisher (`vconsole.engine.publish.kv_events`),
which encodes it in vLLM's wire format. Hashes are the pool's own (Python ints, signed 64-bit);
the publisher maps them to vLLM's unsigned 64-bit form.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None      # None: the first block of a sequence
    token_ids: list[int]               # len(block_hashes) * block_size tokens
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
