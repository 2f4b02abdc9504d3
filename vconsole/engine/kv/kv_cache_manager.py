"""Per-request block tables over the `BlockPool`, with prefix caching.

A request's block table covers positions ``0 .. len(table)*B - 1``; the token at position p lives
in block ``table[p // B]``. The scheduler asks for slots before a step (`allocate_slots`) and
reports after it (`cache_blocks`), when the KV of every position below ``num_computed_tokens`` has
been written. Only then are newly full blocks registered in the prefix cache: a block is
findable only once its KV exists. Blocks holding output tokens are registered too, so a request
that was preempted finds its own blocks again when it resumes.

Invariants:
  * every block in a table holds one reference from that table; a table never lists a block twice.
  * ``_num_registered[r]`` blocks at the start of r's table have been offered to the prefix cache
    (and are full); ``_block_hashes[r]`` is a prefix of r's hash chain, computed lazily.
  * a prefix hit never covers a request's last token, so there is always a token to compute and
    the step produces the logits to sample from.
  * with staging lent (`lend_staging_blocks`, a per-channel KV format), every request with a
    table also holds one more block, ``staging[r]``, in no table: the model runner stages the
    keys of r's open block there (`vconsole.engine.worker.kv_open_blocks`) until the block
    fills. It is taken with the request's first blocks, counted in every figure of what a
    request needs or holds, and freed with its table: a budget holds its blocks plus one per
    running request, not one per seat.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from vconsole.engine.kv.block_pool import BlockPool, hash_block_tokens
from vconsole.engine.request import Request
from vconsole.shared.kv_events import BlockStored, KVEvent
from vconsole.shared.stats import KVStats


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without building the whole list (decode is O(1))."""
    p = request.num_prompt_tokens
    if start >= p:
        return request.output_token_ids[start - p:end - p]
    if end <= p:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[:end - p]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._num_written: dict[str, int] = {}  # tokens whose KV is in the table's blocks
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._staging: dict[str, int] | None = None   # request -> its lent block, when lent

    def lend_staging_blocks(self) -> dict[str, int]:
        """From now on every running request holds one more block for its open block's staged
        keys; returns the live map request -> block (the model runner reads it, read only)."""
        if self._staging is None:
            if self._tables:
                raise RuntimeError("staging must be lent before any request holds blocks")
            self._staging = {}
        return self._staging

    @property
    def staging(self) -> dict[str, int]:
        """Each running request's lent staging block (empty when none are lent)."""
        return self._staging if self._staging is not None else {}

    @property
    def num_staging_blocks(self) -> int:
        """Blocks lent for staging now: one per running request of a per-channel format."""
        return len(self._staging) if self._staging is not None else 0

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def tables(self) -> dict[str, list[int]]:
        """Every request's block table by id (the live dict: read only; the scheduler's per-step
        output reads it without a call per request)."""
        return self._tables

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: copy it before keeping it)."""
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds (what freeing it gives back): its table and staging."""
        lent = self._staging is not None and request_id in self._staging
        return len(self._tables.get(request_id, ())) + lent

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds: its table's, plus a lent one."""
        return self._table_blocks(num_tokens) + (self._staging is not None)

    def _table_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's hash chain, extended to at least ``num_blocks`` full blocks."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        B = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_slice(request, i * B, (i + 1) * B)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Returns ``(block_ids, num_cached_tokens)`` with ``num_cached_tokens`` a multiple of the
        block size and at most ``num_tokens - 1``. Changes nothing: pass the blocks to
        `allocate_slots` to take them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        B = self.block_size
        max_blocks = (request.num_tokens - 1) // B
        hashes = self._block_hashes.setdefault(request.request_id, [])
        blocks: list[int] = []
        for i in range(max_blocks):
            if i == len(hashes):
                self._hashes(request, i + 1)
            b = self.pool.get_cached_block(hashes[i])
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * B

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        cached_blocks: Sequence[int]) -> int:
        total = (request.num_computed_tokens + len(cached_blocks) * self.block_size
                 + num_new_tokens)
        have = len(self._tables.get(request.request_id, ()))
        lend = self._staging is not None and request.request_id not in self._staging
        return max(0, self._table_blocks(total) - have - len(cached_blocks)) + lend

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int,
                               cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks `allocate_slots` would take: new ones plus cached ones it revives."""
        pool = self.pool
        return (self._num_new_blocks(request, num_new_tokens, cached_blocks)
                + sum(1 for b in cached_blocks if pool.ref_count(b) == 0))

    # --- changes ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> bool:
        """Make the table cover ``num_computed_tokens + cached + num_new_tokens`` positions.

        ``cached_blocks`` (from `get_computed_blocks`) are only accepted for a request without a
        table, i.e. at admission. Returns False and changes nothing when the pool cannot supply
        the new blocks; free cached blocks count as allocatable, except those this very call
        revives.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table and not cached_blocks and (len(table) * self.block_size
                                            >= request.num_computed_tokens + num_new_tokens):
            return True  # the common decode step: the last block still has room
        if cached_blocks and table:
            raise ValueError("cached blocks can only be taken by a request without blocks")
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, cached_blocks)
        pool = self.pool
        if self.num_free_blocks_needed(request, num_new_tokens, cached_blocks) \
                > pool.num_free_blocks:
            return False
        if table is None:
            table = self._tables[rid] = []
            self._num_written[rid] = request.num_computed_tokens + num_cached_tokens
            self._num_registered[rid] = len(cached_blocks)
            # First admission only: a resumed request mostly finds its own blocks again, which
            # says nothing about how much prompts share. A request that wants its prompt's
            # logprobs never reads the cache, so it asks it nothing (as vLLM counts).
            if self.enable_prefix_caching and request.num_preemptions == 0 \
                    and not request.needs_prompt_logprobs:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_cached_tokens
        if cached_blocks:
            pool.touch(cached_blocks)  # before allocating, so allocation cannot evict them
            table.extend(cached_blocks)
        if self._staging is not None and rid not in self._staging:
            self._staging[rid] = pool.get_new_blocks(1)[0]
            num_new_blocks -= 1
        if num_new_blocks:
            table.extend(pool.get_new_blocks(num_new_blocks))
        return True

    def cache_blocks(self, request: Request) -> None:
        """After a step: record the KV written below ``request.num_computed_tokens`` and register
        the blocks that became full in the prefix cache."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        B, pool = self.block_size, self.pool
        computed = request.num_computed_tokens
        if computed > len(table) * B:
            computed = len(table) * B
        written = self._num_written[rid]
        if computed > written:
            first, last = written // B, (computed - 1) // B
            if first == last:  # decode: one block's fill grows
                pool.set_fill(table[first], computed - first * B)
            else:
                for i in range(first, last + 1):
                    pool.set_fill(table[i], min(B, computed - i * B))
            self._num_written[rid] = computed
        if not self.enable_prefix_caching:
            return
        full = computed // B
        start = self._num_registered[rid]
        if full > start:
            hashes = self._hashes(request, full)
            if pool.events is None:
                for i in range(start, full):
                    pool.cache_full_block(table[i], hashes[i])
            else:
                self._cache_with_events(request, table, hashes, start, full)
            self._num_registered[rid] = full

    def cache_step(self, requests: Iterable[Request]) -> None:
        """`cache_blocks` for each of a step's requests, in order (so KV events come out in
        that order), in one call. The common case — the KV written stays inside one block that
        does not fill up — only collects (block, fill) for one `BlockPool.set_fills` at the end
        (no other request of the step can write that block: it is partial, so it is in no other
        table). Every other request (a block fills, a prefill spans blocks, registration lags
        after prefix caching came back on) goes through `cache_blocks` at its turn."""
        tables, written_of, registered = self._tables, self._num_written, self._num_registered
        B, caching, slow = self.block_size, self.enable_prefix_caching, self.cache_blocks
        blocks: list[int] = []
        fills: list[int] = []
        for req in requests:
            rid = req.request_id
            table = tables.get(rid)
            if table is None:
                continue
            computed, written = req.num_computed_tokens, written_of[rid]
            first = written // B
            if (written < computed < (first + 1) * B and first < len(table)
                    and (not caching or registered[rid] >= first)):
                blocks.append(table[first])
                fills.append(computed - first * B)
                written_of[rid] = computed
            else:
                slow(req)
        self.pool.set_fills(blocks, fills)

    def _cache_with_events(self, request: Request, table: list[int], hashes: list[int],
                           start: int, full: int) -> None:
        """`cache_full_block` for blocks ``start:full``, with a `BlockStored` per run of blocks
        it registered (a block another request registered first breaks the run)."""
        B, pool, events = self.block_size, self.pool, self.pool.events
        assert events is not None
        run = -1                                   # first block of the current run
        for i in range(start, full + 1):
            stored = i < full and pool.cache_full_block(table[i], hashes[i])
            if stored and run < 0:
                run = i
            elif not stored and run >= 0:
                events.append(BlockStored(hashes[run:i], hashes[run - 1] if run else None,
                                          token_slice(request, run * B, i * B), B))
                run = -1

    def enable_events(self) -> None:
        """Record `vconsole.shared.kv_events` from now on (`take_events` collects them)."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list[KVEvent]:
        """The events since the last call (empty when events are off)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first: freed blocks join the LRU tail in that
        order, so a sequence's tail is evicted before the prefix other requests may share."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        lent = self._staging.pop(rid, None) if self._staging is not None else None
        if lent is not None:
            self.pool.free_blocks((lent,))
        if table:
            self.pool.free_blocks(reversed(table))
        self._block_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._num_written.pop(rid, None)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Hot toggle. Switching off forgets every cached hash (no lookups, no hashing from now
        on); switching on starts registering again from each running request's first block."""
        if enabled == self.enable_prefix_caching:
            return
        self.enable_prefix_caching = enabled
        if not enabled:
            self.pool.reset_prefix_cache()
            self._block_hashes.clear()
            for rid in self._num_registered:
                self._num_registered[rid] = 0

    # --- telemetry ----------------------------------------------------------------------------
    def kv_stats(self) -> KVStats:
        pool = self.pool
        n, B = self.num_blocks, self.block_size
        ages = pool.residency.ages() if pool.residency is not None \
            and len(pool.residency.stamps) else None
        used = pool.num_used_blocks
        stored = pool.tokens_stored
        # Lent staging blocks are used but hold no token by design: not fragmentation.
        holding = used - self.num_staging_blocks
        return KVStats(
            num_blocks=n, block_size=B,
            num_free=pool.num_free_blocks - pool.num_cached_blocks,
            num_used=used,
            num_cached=pool.num_cached_blocks,
            num_shared=pool.num_shared_blocks,
            usage=used / n,
            token_usage=stored / (n * B),
            fragmentation=1.0 - stored / (holding * B) if holding > 0 else 0.0,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            block_states=pool.block_states.copy(),
            block_age_s=ages, block_age_ts=time.time() if ages is not None else 0.0,
        )
