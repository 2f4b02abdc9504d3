"""`bench kv-ideas`' K/V probe reused across calls, as the bench reuses it for the demo mix and
then the serve mix: each call sees the K/V of the tokens it asked for, never those of an earlier
call's sequence that had the same index or a shorter prefix."""

from __future__ import annotations

import pytest

from vconsole.tools.bench.kv_ideas_census import BlockRef
from vconsole.tools.bench.kv_ideas_deltas import KVProbe, kv_deltas

B = 4


@pytest.fixture(scope="module")
def model():
    from vconsole.engine.worker.model_loader import load_model

    model, _, _ = load_model("tiny", "cpu", "float32")
    model.set_attn_implementation("sdpa")
    return model


def test_a_longer_prefix_of_the_same_sequence_is_recomputed(model) -> None:
    seqs = [[5, 6, 7, 8, 20, 21, 22, 23, 30, 31, 32, 33],
            [9, 9, 9, 9, 20, 21, 22, 23, 30, 31, 32, 33]]
    probe = KVProbe(model)
    kv_deltas(probe, seqs, [BlockRef(1, 1, 0, 1)], B)        # sequence 0's first 8 tokens last
    again = kv_deltas(probe, seqs, [BlockRef(0, 2, 1, 2)], B)  # its first 12 tokens first
    assert again == kv_deltas(KVProbe(model), seqs, [BlockRef(0, 2, 1, 2)], B)


def test_another_mix_with_the_same_sequence_index_is_recomputed(model) -> None:
    demo = [[5, 6, 7, 8, 20, 21, 22, 23], [9, 9, 9, 9, 20, 21, 22, 23]]
    serve = [[40, 41, 42, 43, 20, 21, 22, 23], [9, 9, 9, 9, 20, 21, 22, 23]]
    probe = KVProbe(model)
    kv_deltas(probe, demo, [BlockRef(1, 1, 0, 1)], B)        # leaves demo's sequence 0 cached
    served = kv_deltas(probe, serve, [BlockRef(0, 1, 1, 1)], B)
    assert served == kv_deltas(KVProbe(model), serve, [BlockRef(0, 1, 1, 1)], B)
