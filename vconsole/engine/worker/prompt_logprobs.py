"""Prompt logprobs (vLLM's ``prompt_logprobs``) from the forward pass that prefills the prompt.

A request that asks for them has every prompt row of its chunks sent through the LM head, not
only its sample row: row ``p`` (position ``p``) scores the prompt token at ``p + 1``. The other
requests of the step keep the sample-rows-only path. `PromptRows` collects, while the runner
packs the step, which packed rows those are and which token each one scores;
`score_rows` runs the LM head over them in slices (the (rows, vocab) float32 logits of a
512-token window of a 49k vocabulary are 100 MB) and takes each row's log-softmax in float32.

A chunked prompt accumulates its chunks in the runner's request state (`CachedRequestState
.prompt_logprobs`) and hands the whole prompt's over in the step that samples its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vconsole.engine.worker.request_state import ScheduledSeq
from vconsole.wire.outputs import PromptLogprobs

SLICE_ROWS = 256    # LM-head rows per slice: bounds the step's logits memory


@dataclass
class PromptRows:
    """The prompt rows of one step: packed row indices, the token each scores, and per
    request (in the rows' order) how many rows it owns and how many top logprobs it wants."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[tuple[ScheduledSeq, int]] = field(default_factory=list)

    def add(self, seq: ScheduledSeq, offset: int) -> None:
        """``seq`` was packed from row ``offset``: its rows that score a prompt token."""
        state = seq.state
        start = seq.start_pos
        end = min(start + seq.num_tokens, state.num_prompt_tokens - 1)
        if state.prompt_logprobs is None or end <= start:
            return
        self.rows.extend(range(offset, offset + end - start))
        self.targets.extend(state.token_ids[start + 1:end + 1])
        self.owners.append((seq, end - start))

    @property
    def top_k(self) -> int:
        return max((s.state.sampling.prompt_logprobs or 0 for s, _ in self.owners), default=0)


def score_rows(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               targets: torch.Tensor, top_k: int) -> PromptLogprobs:
    """For each row of ``hidden`` (R, hidden): the logprob and rank of ``targets[row]`` and the
    ``top_k`` best tokens, in float32, a `SLICE_ROWS` slice of the LM head at a time."""
    out = PromptLogprobs()
    for lo in range(0, hidden.shape[0], SLICE_ROWS):
        lp = lm_head(hidden[lo:lo + SLICE_ROWS]).float().log_softmax(dim=-1)
        chosen = lp.gather(1, targets[lo:lo + SLICE_ROWS, None])
        ranks = (lp >= chosen).sum(dim=-1, dtype=torch.int32)   # 2.5x an int64 sum
        out.token_logprobs.extend(chosen[:, 0].tolist())
        out.ranks.extend(ranks.tolist())
        if top_k:
            top_lp, top_ids = lp.topk(top_k, dim=-1)
            out.top_ids.extend(top_ids.tolist())
            out.top_logprobs.extend(top_lp.tolist())
        else:
            out.top_ids.extend([] for _ in range(lp.shape[0]))
            out.top_logprobs.extend([] for _ in range(lp.shape[0]))
    return out


def accumulate(prompt: PromptRows, scored: PromptLogprobs) -> None:
    """Hand each owner its rows of ``scored`` (cut to its own top-k) into its request state."""
    at = 0
    for seq, n in prompt.owners:
        k = seq.state.sampling.prompt_logprobs or 0
        acc = seq.state.prompt_logprobs
        assert acc is not None
        acc.extend(PromptLogprobs(scored.token_logprobs[at:at + n], scored.ranks[at:at + n],
                                  [ids[:k] for ids in scored.top_ids[at:at + n]],
                                  [lps[:k] for lps in scored.top_logprobs[at:at + n]]))
        at += n


def take_finished(seqs: list[ScheduledSeq]) -> dict[str, PromptLogprobs]:
    """The prompt logprobs of requests whose prompt this step completed (they sample now), taken
    out of their states so that later steps compute none."""
    done: dict[str, PromptLogprobs] = {}
    for s in seqs:
        if s.do_sample and s.state.prompt_logprobs is not None:
            done[s.req_id] = s.state.prompt_logprobs
            s.state.prompt_logprobs = None
    return done
