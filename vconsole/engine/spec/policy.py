"""Which requests speculate.

A request speculates unless something of its sampling reads per-position state that a draft
row would have to rebuild at every draft position: a structured-output grammar (its matcher
advances one token at a time; the simplest correct choice is not to draft for it), logprobs
(returned per emitted token by the plain path only), presence / frequency / repetition
penalties (their counts change with every accepted token) and ``min_tokens`` not yet reached
(its ban of EOS ends at a token count). Such a request decodes as without speculation; the
others in the same step still do.
"""

from __future__ import annotations

from vconsole.wire.sampling import SamplingParams


def can_speculate(sampling: SamplingParams, num_output_tokens: int) -> bool:
    return (sampling.structured is None and sampling.logprobs is None
            and not sampling.penalised and num_output_tokens >= sampling.min_tokens)
