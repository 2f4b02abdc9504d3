"""`bench throughput`'s workload: the requests every contender serves (random token ids,
prompt and output lengths drawn from a fixed seed), the pool that holds them all, and the
single stream's prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vconsole.tools.bench.flops import ModelShape


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def flops(self, shape: ModelShape) -> int:
        """Useful FLOPs of serving the whole workload once (`ModelShape.request_flops`)."""
        return sum(shape.request_flops(len(p), n)
                   for p, n in zip(self.prompts, self.output_lens, strict=True))


def make_workload(num_requests: int = 64, seed: int = 0, vocab: int = 250) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(32, 128) for _ in range(num_requests)])


BLOCK_SIZE = 16


def kv_blocks_for(wl: Workload, block_size: int = BLOCK_SIZE) -> int:
    """A pool that holds every request of the workload at once (no preemption), plus slack."""
    return sum(-(-(len(p) + n) // block_size)
               for p, n in zip(wl.prompts, wl.output_lens, strict=True)) + 64


SINGLE_PROMPT = 128
SINGLE_OUTPUT = 256


def single_prompt(vocab: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(SINGLE_PROMPT)]
