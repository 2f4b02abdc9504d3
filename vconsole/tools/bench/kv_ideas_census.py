"""`bench kv-ideas`'s block census: every full block of a set of token sequences classified
against the earlier ones — hash-equal (the prefix cache shares it), the same tokens under
another prefix, a near duplicate, or a copy off the block grid."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.kv.block_pool import hash_block_tokens

NEAR_SHARE = 0.75


@dataclass
class BlockRef:
    """A full block: sequence index, block index, and the earlier block it duplicates."""

    seq: int
    index: int
    ref_seq: int = -1
    ref_index: int = -1          # for a shifted copy: the token offset in ref_seq
    share: float = 1.0           # positions equal to the reference's


@dataclass
class Census:
    block_size: int
    total: int = 0                       # full blocks, every occurrence
    distinct: int = 0                    # distinct hashes (what a prefix cache stores)
    hash_equal: list[BlockRef] = field(default_factory=list)
    same_tokens: list[BlockRef] = field(default_factory=list)   # other prefix, equal tokens
    near: list[BlockRef] = field(default_factory=list)          # >= near_share positions
    shifted: list[BlockRef] = field(default_factory=list)       # tokens elsewhere, unaligned

    def summary(self) -> dict[str, Any]:
        d = max(self.distinct, 1)
        return {"block_size": self.block_size, "full_blocks": self.total,
                "distinct_hashes": self.distinct,
                "hash_equal": len(self.hash_equal),
                "hash_equal_share": round(len(self.hash_equal) / max(self.total, 1), 4),
                "same_tokens_other_prefix": len(self.same_tokens),
                "near_duplicates": len(self.near),
                "shifted_copies": len(self.shifted),
                "candidates_share_of_distinct": round(
                    (len(self.same_tokens) + len(self.near) + len(self.shifted)) / d, 4)}


def block_census(seqs: Sequence[Sequence[int]], block_size: int,
                 near_share: float = NEAR_SHARE) -> Census:
    """Classify every full block of ``seqs`` (token id lists, in arrival order).

    A block is *hash-equal* when an earlier block has its chain hash (`hash_block_tokens`:
    same tokens after the same prefix; the prefix cache shares it). Among the first occurrences
    of each hash, a block is *same tokens* when an earlier distinct block holds exactly its
    tokens (another prefix), else *near* when at least ``near_share`` of its positions equal an
    earlier distinct block's, else *shifted* when its tokens occur in some sequence at an offset
    that is not a block boundary. The rest are unique. Each block counts once, in that order.
    """
    import numpy as np

    B = block_size
    census = Census(B)
    seen_hash: dict[int, tuple[int, int]] = {}
    seen_tokens: dict[tuple[int, ...], tuple[int, int]] = {}
    rows: list[tuple[int, ...]] = []
    where: list[tuple[int, int]] = []
    unaligned: dict[tuple[int, ...], tuple[int, int]] = {}
    for s, seq in enumerate(seqs):
        for off in range(1, len(seq) - B + 1):
            if off % B:
                unaligned.setdefault(tuple(seq[off:off + B]), (s, off))
    matrix = np.zeros((0, B), dtype=np.int64)
    for s, seq in enumerate(seqs):
        parent: int | None = None
        for i in range(len(seq) // B):
            tokens = tuple(seq[i * B:(i + 1) * B])
            h = hash_block_tokens(parent, tokens)
            parent = h
            census.total += 1
            if h in seen_hash:
                rs, ri = seen_hash[h]
                census.hash_equal.append(BlockRef(s, i, rs, ri))
                continue
            seen_hash[h] = (s, i)
            census.distinct += 1
            if tokens in seen_tokens:
                rs, ri = seen_tokens[tokens]
                census.same_tokens.append(BlockRef(s, i, rs, ri))
            else:
                best, j = 0.0, -1
                if len(rows):
                    if matrix.shape[0] != len(rows):
                        matrix = np.asarray(rows, dtype=np.int64)
                    match = (matrix == np.asarray(tokens)).mean(axis=1)
                    j = int(match.argmax())
                    best = float(match[j])
                if best >= near_share:
                    census.near.append(BlockRef(s, i, *where[j], share=best))
                elif tokens in unaligned:
                    census.shifted.append(BlockRef(s, i, *unaligned[tokens]))
                seen_tokens[tokens] = (s, i)
                rows.append(tokens)
                where.append((s, i))
    return census

