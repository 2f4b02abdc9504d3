"""The model runner's side of speculative decoding (`vconsole.engine.spec`): a step's draft rows
verified from their logits, and the next step's drafts proposed.

A draft row is ``1 + len(draft)`` positions of one request fed in one forward; its logits
verify the draft position by position: greedy acceptance at temperature 0 (exactly the tokens
plain decoding would give), else rejection sampling against the sampler's own distribution at
each position (`vconsole.engine.spec.rejection`), so the output distribution is unchanged.
Plain rows of the same step are handed back to sample as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vconsole.engine.sched.output import SchedulerOutput
from vconsole.engine.spec import rejection
from vconsole.engine.spec.draft_length import DraftLength, StepCosts
from vconsole.engine.spec.ngram import NgramProposer
from vconsole.engine.spec.policy import can_speculate
from vconsole.engine.worker.request_state import RequestStates, ScheduledSeq
from vconsole.engine.worker.sampler import Sampler, SamplingBatch
from vconsole.engine.worker.sampler import _mix_seed as mix_seed
from vconsole.shared.speculative import SpeculativeConfig


class DraftVerifier:
    """Verifies draft rows and proposes drafts for one runner (its sampler and device)."""

    def __init__(self, spec: SpeculativeConfig, sampler: Sampler, vocab_size: int,
                 device: torch.device) -> None:
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max)
        # The runner's step times by width, and each request's draft length from them.
        self.costs = StepCosts()
        self.length = DraftLength(spec.num_speculative_tokens, self.costs,
                                  adaptive=spec.draft_length == "adaptive")
        self._proposals = 0
        self._match: dict[str, int] = {}        # request -> its pending draft's match length
        self.sampler, self.vocab_size, self.device = sampler, vocab_size, device

    def verify_rows(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                    emitted: dict[str, list[int]]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Verify every draft row of the step (its tokens go to ``emitted``); returns the
        logits and sequences of the plain rows, which sample as without speculation."""
        plain_rows: list[int] = []
        plain: list[ScheduledSeq] = []
        row = 0
        for s in seqs:
            if not s.draft:
                plain_rows.append(row)
                plain.append(s)
                row += 1
                continue
            n = s.num_tokens
            emitted[s.req_id] = tokens = self._verify(logits[row:row + n], s)
            self.length.record(s.req_id, len(s.draft), len(tokens) - 1,
                               self._match.pop(s.req_id, 0))
            row += n
        index = torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)
        return logits.index_select(0, index), plain

    def _verify(self, logits: torch.Tensor, s: ScheduledSeq) -> list[int]:
        """One draft row: greedy acceptance at temperature 0, else rejection sampling."""
        st = s.state
        sp = st.sampling
        if sp.greedy:
            return rejection.verify_greedy(logits, s.draft)
        n_out = st.num_output_tokens
        n = len(s.draft) + 1
        batch = SamplingBatch.build([sp] * n, [n_out + i for i in range(n)], self.vocab_size,
                                    self.device)
        probs = self.sampler.probabilities(logits, batch)
        generator = self.sampler.generator
        if sp.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(mix_seed(sp.seed, n_out))
        return rejection.verify_sampled(probs, s.draft, generator)

    def propose(self, so: SchedulerOutput, states: RequestStates, sampled: dict[str, int],
                spec_sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """The next step's drafts of the rows that sampled (``so.propose_drafts`` only), each
        looked up in the request's tokens with what this step emitted."""
        if not so.propose_drafts:
            return {}
        out: dict[str, list[int]] = {}
        rows = len(so.num_scheduled_tokens)     # the next step's if nobody drafts, plus the
        for rid, new in [*((r, [t]) for r, t in sampled.items()), *spec_sampled.items()]:
            st = states.get(rid)
            if st is None or not can_speculate(st.sampling, st.num_output_tokens + len(new)):
                continue
            draft = self.proposer.propose(st.token_ids + new)
            match = self.proposer.match_len
            # drafts already given this step: each request sees the rows of those before it
            d = self.length.choose(rid, len(draft), rows, match) if draft else 0
            if d:
                out[rid] = draft[:d]
                self._match[rid] = match
                rows += d
        self._proposals += 1
        if self._proposals % 256 == 0:
            live = set(states)          # the runner's requests, scheduled this step or not
            self.length.forget(live)
            self._match = {r: m for r, m in self._match.items() if r in live}
        return out
