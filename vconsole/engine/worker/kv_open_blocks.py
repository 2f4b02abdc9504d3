"""Open blocks of a per-channel KV format (`int4_kivi`, `int8_kivi`): keys kept in float until
a block fills.

KIVI's observation, measured here by `vconsole bench kv-grouping`: keys have outlier channels,
so 4-bit keys rounded per channel over a block of tokens lose far less than keys rounded per
token (on SmolLM2 +1.2% perplexity against +16%). A channel's scale needs every token of the
block, and a block fills one decode step at a time, so a block that is still filling ("open")
keeps its keys staged in a block of the pool lent to its request, in a form finer than what they become
(`kv_quant`: int8 per row for `int4_kivi`, whose 4-bit step is 20x int8's, so the two roundings
lose what one does; float16 for `int8_kivi`, where a second int8 rounding would not); the step
that writes its
last slot "seals" it: the block's keys are rounded per channel into the pool and its staging
entry is freed. Values are rounded per token as they arrive (per token and head, with a minimum), like
`int4_per_token_head`'s.

`OpenBlocks` is the bookkeeping, run once per step on the host (`plan`); the plan it returns is
the same for every layer (`kv_quant.write` applies it). Invariants:

- an open block's rows ``0 .. fill-1`` are in its staging entry, in order; a sealed block's
  keys are in the pool, rounded over its valid rows;
- ``entry_of[block]`` is the block's staging entry, or -1 when it is sealed (or never written):
  the attention reads a block from staging or the pool by it;
- a request has at most one open block (its writes are contiguous: a step that fills one block
  and starts the next seals the first), so one staging entry per running request holds every
  open block. The entries are blocks of the pool: the KV manager lends each running request
  one (`KVCacheManager.staging`) for as long as it holds blocks, and the plan stages a
  request's open block in that request's block (``staging_of``). The plan seals before it
  opens, so a block filling in this step and the next one opening share the entry;
- a request's lent block goes back to the pool with its other blocks (finished, preempted,
  failed), so an open block whose request the runner no longer holds is dropped, not sealed:
  its entry may already hold another request's keys, and its own block is free (a partial
  block is never in the prefix cache). A request opening a block while it still owns another
  open one (left behind when it was preempted and its blocks freed) drops that one likewise.
  The plan touches only this step's blocks and dead ones, so a step that fails (its requests
  failed with it) leaves no other request's keys half-moved;
- a request without a lent block (a runner stepped without a KV manager: tests, tools) gets
  its block sealed early over its filled rows (`early_seals` counts them; a precision matter,
  not a correctness one); its next write re-opens it from its rounded keys only when it has an
  entry by then.

A block restarting from offset 0 (freed and reused) drops its old rows.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class OpenPlan:
    """One step's routing of new key rows, for every layer. Rows of ``work`` are
    ``seal_index * block_size + offset``; staging rows are ``entry * block_size + offset``;
    batch rows index the step's packed tokens."""

    seal_blocks: torch.Tensor      # (S,) blocks sealed by this step
    seal_fill: torch.Tensor        # (S,) their valid rows (block_size unless sealed early)
    work_from_stage: tuple[torch.Tensor, torch.Tensor]   # (work rows, staging rows)
    work_from_sealed: tuple[torch.Tensor, torch.Tensor]  # (seal indices, sealed blocks)
    reload: tuple[torch.Tensor, torch.Tensor]            # (entries, sealed blocks) to re-open
    stage_from_batch: tuple[torch.Tensor, torch.Tensor]  # (staging rows, batch rows)
    work_from_batch: tuple[torch.Tensor, torch.Tensor]   # (work rows, batch rows)
    fresh_entries: torch.Tensor    # (E,) staging entries a block starts in by this step
    entry_of: torch.Tensor         # (NB,) int64 after this step


def _pair(a: list[int], b: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(a + b, dtype=torch.int64, device=device)
    return t[:len(a)], t[len(a):]


class OpenBlocks:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.entry_of = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self._entry: dict[int, int] = {}                 # open block -> entry
        self._block_at: dict[int, int] = {}              # entry -> the open block staged there
        self._fill: dict[int, int] = {}                  # open block -> rows filled
        self._owner: dict[int, str] = {}                 # open block -> the request writing it
        self._open_of: dict[str, int] = {}               # request -> its open block
        self.early_seals = 0                             # blocks sealed before they filled

    @property
    def num_open(self) -> int:
        return len(self._entry)

    def plan(self, writes: list[tuple[int, int, int, int, str]], live: Collection[str],
             staging_of: Mapping[str, int]) -> OpenPlan:
        """``writes``: ``(block, first offset, end offset, first batch row, request id)`` for
        each run of new tokens of this step, in any order (no block twice); ``live``: the
        requests the runner holds; ``staging_of``: each running request's lent block (the KV
        manager's)."""
        bs = self.block_size
        touched = {w[0] for w in writes}
        seals: list[tuple[int, int]] = []                # (block, fill)
        wfs_dst: list[int] = []
        wfs_src: list[int] = []
        wsealed_idx: list[int] = []
        wsealed_blk: list[int] = []
        rl_entry: list[int] = []
        rl_blk: list[int] = []
        sfb_dst: list[int] = []
        sfb_src: list[int] = []
        wfb_dst: list[int] = []
        wfb_src: list[int] = []
        fresh_entries: list[int] = []
        changed: dict[int, int] = {}

        def drop(block: int) -> None:
            """Forget an open block whose request is gone (or left it behind): no data moves."""
            e = self._entry.pop(block)
            self._block_at.pop(e, None)
            del self._fill[block]
            self._disown(block)
            changed[block] = -1

        for block in [b for b, o in self._owner.items() if o not in live]:
            drop(block)

        def take_entry(owner: str, block: int) -> int | None:
            e = staging_of.get(owner)
            if e is None:
                return None
            held = self._block_at.get(e)
            if held is not None and held != block:   # a dead or stale block still listed
                drop(held)
            return e

        # Seals first: their entries are free for the blocks this step opens.
        for block, lo, hi, row, owner in sorted(writes, key=lambda w: w[2] != bs):
            if lo == 0 and block in self._entry:   # (re)starting: nothing earlier counts
                drop(block)
            e = self._entry.get(block)
            if hi == bs:                      # full after this step: seal it
                s = len(seals)
                if e is not None:
                    e_rows = self._fill[block] if lo > 0 else 0
                    del self._entry[block], self._fill[block]
                    self._block_at.pop(e, None)
                    self._disown(block)
                    wfs_dst.extend(range(s * bs, s * bs + e_rows))
                    wfs_src.extend(range(e * bs, e * bs + e_rows))
                elif lo > 0:                  # sealed early before: its rounded rows
                    wsealed_idx.append(s)
                    wsealed_blk.append(block)
                seals.append((block, bs))
                wfb_dst.extend(range(s * bs + lo, s * bs + hi))
                wfb_src.extend(range(row, row + hi - lo))
                changed[block] = -1
                continue
            if e is None:
                stale = self._open_of.get(owner)
                if stale in self._entry and stale not in touched \
                        and self._owner.get(stale) == owner:
                    drop(stale)                # left behind by a preemption
                e = take_entry(owner, block)
                if e is None:                 # no entry to be had: this block is sealed early
                    s = len(seals)
                    if lo > 0:
                        wsealed_idx.append(s)
                        wsealed_blk.append(block)
                    seals.append((block, hi))
                    self._early_seal()
                    wfb_dst.extend(range(s * bs + lo, s * bs + hi))
                    wfb_src.extend(range(row, row + hi - lo))
                    changed[block] = -1
                    continue
                if lo > 0:                    # re-open a block sealed early
                    rl_entry.append(e)
                    rl_blk.append(block)
                else:
                    fresh_entries.append(e)
                self._entry[block] = e
                self._block_at[e] = block
                changed[block] = e
            self._fill[block] = hi
            if self._owner.get(block) not in (None, owner):   # restarted by another request
                self._disown(block)
            self._owner[block] = owner
            self._open_of[owner] = block
            sfb_dst.extend(range(e * bs + lo, e * bs + hi))
            sfb_src.extend(range(row, row + hi - lo))

        if changed:
            idx = torch.tensor(list(changed), dtype=torch.int64, device=self.device)
            val = torch.tensor(list(changed.values()), dtype=torch.int64, device=self.device)
            self.entry_of.index_copy_(0, idx, val)
        dev = self.device
        blocks = [b for b, _ in seals]
        fills = [f for _, f in seals]
        return OpenPlan(
            seal_blocks=torch.tensor(blocks, dtype=torch.int64, device=dev),
            seal_fill=torch.tensor(fills, dtype=torch.int64, device=dev),
            work_from_stage=_pair(wfs_dst, wfs_src, dev),
            work_from_sealed=_pair(wsealed_idx, wsealed_blk, dev),
            reload=_pair(rl_entry, rl_blk, dev),
            stage_from_batch=_pair(sfb_dst, sfb_src, dev),
            work_from_batch=_pair(wfb_dst, wfb_src, dev),
            fresh_entries=torch.tensor(fresh_entries, dtype=torch.int64, device=dev),
            entry_of=self.entry_of)

    def _disown(self, block: int) -> None:
        owner = self._owner.pop(block, None)
        if owner is not None and self._open_of.get(owner) == block:
            del self._open_of[owner]

    def _early_seal(self) -> None:
        if self.early_seals == 0:
            log.warning("per-channel KV keys: a request has no staging block (a runner "
                        "stepped without a KV manager): its open blocks are rounded before "
                        "they fill, with less precision")
        self.early_seals += 1
