"""The pool of KV cache blocks: who holds which block, which free blocks still hold a reusable
prefix, and a per-block state map the console draws.

Block ids are ``0 .. num_blocks-1``; the model runner owns the real K/V tensors indexed by them.
This module only keeps the books, in flat arrays, so that every operation is O(1) per block and
nothing allocates a Python object per block per step (the pool may hold a million blocks).

Free list. An intrusive doubly linked list over the ``_prev``/``_next`` arrays with a sentinel at
index ``num_blocks``. Allocation pops the head (the least recently freed block), freeing appends at
the tail, and a prefix-cache hit on a free block unlinks it from the middle ("touch"). Because a
freed block that holds a hash stays in the list until it is popped, the list doubles as the LRU
order of the prefix cache: eviction happens exactly when a cached block is allocated for
something else.

Prefix cache. A *full* block is identified by ``hash_block_tokens(parent_hash, tokens)``, a chain
over the whole prefix, so equal hashes mean equal prefixes (up to a 64-bit collision). ``_cached``
maps hash -> block id, ``_hash_of`` the reverse; both only hold blocks registered through
`cache_full_block`.

Invariants (checked by `check_invariants`, which tests call):
  * ``ref_cnt[b] == 0``  <=>  b is in the free list; ``_num_free`` is the list's length.
  * ``block_states[b]`` is BLOCK_FREE (ref 0, no hash), BLOCK_CACHED (ref 0, hash),
    BLOCK_USED (ref 1) or BLOCK_SHARED (ref > 1); the counters match these states.
  * ``_cached[h] == b``  <=>  ``_hash_of[b] == h``; a hash maps to exactly one block.
  * ``_tokens_stored == sum(fill[b] for b with ref_cnt[b] > 0)``; a shared block counts once.
    Free blocks without a hash have ``fill == 0``; cached free blocks keep ``fill == block_size``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from vconsole.engine.kv.residency import BlockResidency
from vconsole.shared.kv_events import AllBlocksCleared, BlockRemoved, KVEvent
from vconsole.shared.stats import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED

_ROOT_HASH = 0x5EED  # parent of a sequence's first block


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash: identifies the whole prefix up to it.

    Python's hash of a tuple of ints is deterministic across processes (no hash randomization
    for ints), so hashes are stable between runs.
    """
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        n = num_blocks
        self._sentinel = n
        # Block i links to i-1 and i+1; the sentinel closes the ring.
        self._next = array("i", range(1, n + 2))
        self._prev = array("i", range(-1, n))
        self._next[n] = 0
        self._prev[0] = n
        self._prev[n] = n - 1
        self._ref = array("i", bytes(4 * n))
        self._fill = array("i", bytes(4 * n))
        self.block_states = np.full(n, BLOCK_FREE, dtype=np.uint8)
        self._cached: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._num_free = n           # length of the free list, cached blocks included
        self._num_cached_free = 0    # free blocks that still hold a hash
        self._num_shared = 0
        self._tokens_stored = 0
        # Evictions and resets as events (`vconsole.shared.kv_events`); None: not recorded.
        self.events: list[KVEvent] | None = None
        # Sampled block lifetimes (`vconsole.engine.kv.residency`); None: not measured.
        self.residency: BlockResidency | None = None

    # --- counts, all O(1) ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: plain free ones and evictable cached ones."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_shared_blocks(self) -> int:
        return self._num_shared

    @property
    def tokens_stored(self) -> int:
        return self._tokens_stored

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of.get(block_id)

    def free_list(self) -> list[int]:
        """Free blocks from head (next to be allocated) to tail. O(n): for tests and debugging."""
        out, s = [], self._sentinel
        b = self._next[s]
        while b != s:
            out.append(b)
            b = self._next[b]
        return out

    # --- free list primitives -----------------------------------------------------------------
    def _unlink(self, b: int) -> None:
        p, nx = self._prev[b], self._next[b]
        self._next[p] = nx
        self._prev[nx] = p
        self._prev[b] = self._next[b] = -1

    def _push_tail(self, b: int) -> None:
        s = self._sentinel
        last = self._prev[s]
        self._next[last] = b
        self._prev[b] = last
        self._next[b] = s
        self._prev[s] = b

    # --- operations ---------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free list (ref 1, empty). A cached block taken
        this way is evicted: its hash is forgotten."""
        if n > self._num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self._num_free} free")
        out = []
        nxt, s, states = self._next, self._sentinel, self.block_states
        for _ in range(n):
            b = nxt[s]
            self._unlink(b)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._cached[h]
                self._num_cached_free -= 1
                if self.events is not None:
                    self.events.append(BlockRemoved([h]))
            self._ref[b] = 1
            self._fill[b] = 0
            states[b] = BLOCK_USED
            out.append(b)
        self._num_free -= n
        if self.residency is not None:
            self.residency.allocated(out)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hit). A free cached block is revived:
        unlinked from the middle of the free list, and its tokens count as stored again."""
        ref, states = self._ref, self.block_states
        residency = self.residency
        if residency is not None and (residency.tracking or len(residency.stamps)):
            block_ids = list(block_ids)
            residency.touched(block_ids)
        for b in block_ids:
            r = ref[b]
            if r == 0:
                self._unlink(b)
                self._num_free -= 1
                if b in self._hash_of:
                    self._num_cached_free -= 1
                self._tokens_stored += self._fill[b]
                states[b] = BLOCK_USED
            elif r == 1:
                self._num_shared += 1
                states[b] = BLOCK_SHARED
            ref[b] = r + 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; a block whose count reaches zero
        goes to the tail of the free list (so blocks freed later are evicted later)."""
        ref, states = self._ref, self.block_states
        for b in block_ids:
            r = ref[b]
            if r <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            ref[b] = r - 1
            if r == 2:
                self._num_shared -= 1
                states[b] = BLOCK_USED
            elif r == 1:
                self._push_tail(b)
                self._num_free += 1
                self._tokens_stored -= self._fill[b]
                if b in self._hash_of:
                    self._num_cached_free += 1
                    states[b] = BLOCK_CACHED
                else:
                    self._fill[b] = 0
                    states[b] = BLOCK_FREE

    def set_fill(self, block_id: int, num_tokens: int) -> None:
        """Record how many tokens of a used block hold written KV (for token usage)."""
        delta = num_tokens - self._fill[block_id]
        if delta:
            self._fill[block_id] = num_tokens
            if self._ref[block_id] > 0:
                self._tokens_stored += delta

    def set_fills(self, block_ids: Sequence[int], fills: Sequence[int]) -> None:
        """`set_fill` for each ``(block_ids[i], fills[i])``, in order, in one call (a step's
        decode writes: one block per request)."""
        fill, ref = self._fill, self._ref
        stored = 0
        for b, num_tokens in zip(block_ids, fills, strict=True):
            delta = num_tokens - fill[b]
            if delta:
                fill[b] = num_tokens
                if ref[b] > 0:
                    stored += delta
        self._tokens_stored += stored

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Register a used, full block under its hash. Returns False (and does nothing) when the
        block already has a hash or another block already holds this prefix (two requests
        computed the same prefix at once: the first one registered wins)."""
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if block_id in self._hash_of or block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash (prefix caching switched off). Cached free blocks become plain free
        blocks; used blocks keep their data and simply stop being findable. O(cached)."""
        for b in self._hash_of:
            if self._ref[b] == 0:
                self.block_states[b] = BLOCK_FREE
                self._fill[b] = 0
        self._num_cached_free = 0
        self._cached.clear()
        self._hash_of.clear()
        if self.residency is not None:
            self.residency.reset()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def recount(self) -> None:
        """Rebuild what only telemetry reads — the shared/cached/stored counters and
        ``block_states`` — from the reference counts, fills and hashes (the truth the
        allocator uses). O(num_blocks); after a telemetry failure (`TelemetryGuard`)."""
        ref, fill, hashed = self._ref, self._fill, self._hash_of
        states = np.empty(self.num_blocks, dtype=np.uint8)
        shared = cached = stored = 0
        for b in range(self.num_blocks):
            r = ref[b]
            if r == 0:
                is_cached = b in hashed
                cached += is_cached
                states[b] = BLOCK_CACHED if is_cached else BLOCK_FREE
            else:
                shared += r > 1
                stored += fill[b]
                states[b] = BLOCK_SHARED if r > 1 else BLOCK_USED
        self.block_states = states
        self._num_shared, self._num_cached_free, self._tokens_stored = shared, cached, stored

    # --- checking -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring. O(num_blocks)."""
        free = self.free_list()
        assert len(free) == len(set(free)) == self._num_free, "free list corrupt"
        in_free = set(free)
        shared = cached = stored = 0
        for b in range(self.num_blocks):
            r, st, hashed = self._ref[b], self.block_states[b], b in self._hash_of
            assert r >= 0
            assert (r == 0) == (b in in_free), f"block {b}: ref {r} vs free list"
            if r == 0:
                assert st == (BLOCK_CACHED if hashed else BLOCK_FREE), f"block {b} state {st}"
                cached += hashed
                if not hashed:
                    assert self._fill[b] == 0
            else:
                assert st == (BLOCK_SHARED if r > 1 else BLOCK_USED), f"block {b} state {st}"
                shared += r > 1
                stored += self._fill[b]
        assert cached == self._num_cached_free
        assert shared == self._num_shared
        assert stored == self._tokens_stored, (stored, self._tokens_stored)
        assert len(self._cached) == len(self._hash_of)
        for h, b in self._cached.items():
            assert self._hash_of[b] == h
