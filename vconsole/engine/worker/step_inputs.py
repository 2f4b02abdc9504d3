"""The packed step's inputs, as the model runner lays them out: `PreparedStep` (token ids,
positions, the paged-attention metadata, which rows sample and which prompt rows are scored),
the pool slots a request's positions write (`slots`), the blocks a step writes
(`block_writes`, the open-block staging's plan), the decode rows' groups for attention
(`decode_groups`) and a draft step's rows as decode rows for the native step (`decode_view`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vconsole.engine.worker.paged_attention import PagedAttentionMetadata
from vconsole.engine.worker.prompt_logprobs import PromptRows
from vconsole.engine.worker.request_state import ScheduledSeq


@dataclass
class PreparedStep:
    input_ids: torch.Tensor       # (1, T)
    positions: torch.Tensor       # (1, T)
    metadata: PagedAttentionMetadata
    sample_rows: torch.Tensor     # (S,) indices into the packed batch
    sample_seqs: list[ScheduledSeq]
    prompt: PromptRows | None = None          # prompt rows scored for prompt logprobs
    prompt_rows: torch.Tensor | None = None   # (P,) their indices into the packed batch
    prompt_targets: torch.Tensor | None = None  # (P,) the token each scores
    prompt_hidden: torch.Tensor | None = None   # (P, hidden), set by the forward


def slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of positions ``start .. end-1``, one ``range`` per block touched."""
    out: list[int] = []
    p = start
    while p < end:
        off = p % block_size
        take = min(block_size - off, end - p)
        base = block_ids[p // block_size] * block_size + off
        out.extend(range(base, base + take))
        p += take
    return out


def block_writes(ordered: Sequence[ScheduledSeq], block_size: int
                  ) -> list[tuple[int, int, int, int, str]]:
    """``(block, first offset, end offset, first batch row, request)`` of every block the
    packed step writes (`OpenBlocks.plan`'s input)."""
    out: list[tuple[int, int, int, int, str]] = []
    row = 0
    for s in ordered:
        p, end = s.start_pos, s.start_pos + s.num_tokens
        while p < end:
            off = p % block_size
            take = min(block_size - off, end - p)
            out.append((s.block_ids[p // block_size], off, off + take, row, s.req_id))
            row += take
            p += take
    return out


DECODE_GROUP_ROWS = 16
DECODE_MAX_GROUPS = 4


def decode_groups(num_decodes: int) -> list[tuple[int, int]]:
    """Split sorted decode rows into at most DECODE_MAX_GROUPS contiguous groups of at least
    DECODE_GROUP_ROWS rows: less padding in the gathers, without an attention call per row."""
    if num_decodes == 0:
        return []
    k = max(1, min(DECODE_MAX_GROUPS, num_decodes // DECODE_GROUP_ROWS))
    size = -(-num_decodes // k)
    return [(lo, min(lo + size, num_decodes)) for lo in range(0, num_decodes, size)]


def decode_view(ordered: Sequence[ScheduledSeq], chunks: Sequence[ScheduledSeq],
                num_tokens: int, block_size: int, max_rows: int
                ) -> tuple[int, list[int], list[int]]:
    """For a step of decode and draft rows the native decode step runs (`native_decode`, up to
    ``max_rows`` rows; 0: it runs none): every packed row as a decode row, its block table
    (padded with block 0 to the widest row's blocks, which it returns first) and context
    length ``position + 1`` (a draft row's tokens are rows of its request at consecutive
    positions). Nothing for a pure decode step (its decode group is the view), a step with a
    prefill chunk, or one wider than the plan runs."""
    if (not max_rows or not chunks or num_tokens > max_rows
            or not all(s.draft and s.start_pos for s in chunks)):
        return 0, [], []
    width = max(-(-(s.start_pos + s.num_tokens) // block_size) for s in ordered)
    tables: list[int] = []
    lens: list[int] = []
    for s in ordered:
        for p in range(s.start_pos, s.start_pos + s.num_tokens):
            padded_table(tables, s.block_ids, p, block_size, width)
            lens.append(p + 1)
    return width, tables, lens


def padded_table(out: list[int], block_ids: Sequence[int], pos: int, block_size: int,
                 width: int) -> None:
    """Append the block table of a row at position ``pos`` (its blocks up to that position)
    to ``out``, padded with block 0 to ``width`` blocks (masked out by context length)."""
    n = pos // block_size + 1
    out.extend(block_ids[:n])
    out.extend([0] * (width - n))
