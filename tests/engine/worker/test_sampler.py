"""Sampler: greedy, temperature, top-k, top-p and per-request seeds, on synthetic logits."""

from __future__ import annotations

import torch

from vconsole.engine.worker.sampler import Sampler, SamplingBatch
from vconsole.wire.sampling import SamplingParams

CPU = torch.device("cpu")
V = 64


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None,
           sampler: Sampler | None = None) -> list[int]:
    steps = steps if steps is not None else [0] * len(params)
    batch = SamplingBatch.build(params, steps, logits.shape[-1], CPU)
    return (sampler or Sampler(CPU, seed=0))(logits, batch).tolist()


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * scale


def test_greedy_is_argmax_and_all_greedy_shortcut() -> None:
    logits = random_logits(8)
    assert sample(logits, [SamplingParams()] * 8) == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(32, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    assert sample(logits, params) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    logits = random_logits(32, seed=2, scale=1.0)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 32
    assert sample(logits, params) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = random_logits(6, seed=3, scale=0.5)
    params = [SamplingParams(), SamplingParams(temperature=2.0)] * 3
    out = sample(logits, params)
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_same_seed_same_tokens_regardless_of_neighbours() -> None:
    row = random_logits(1, seed=4, scale=0.3)           # flat: many plausible tokens
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone, crowded = [], []
    for step in range(20):
        alone += sample(row, [seeded], [step], Sampler(CPU, seed=step))
        others = random_logits(5, seed=100 + step)
        logits = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=7),
                  seeded, SamplingParams(temperature=1.0, top_k=5),
                  SamplingParams(temperature=1.0, top_p=0.5, seed=99), SamplingParams()]
        crowded.append(sample(logits, params, [3, step, step, 0, 1, 0],
                              Sampler(CPU, seed=1000 + step))[2])
    assert alone == crowded
    assert len(set(alone)) > 5  # it really sampled


def test_seed_is_a_function_of_seed_and_step_only() -> None:
    """Recompute after preemption samples again at the same step: same token."""
    row = random_logits(1, seed=5, scale=0.3)
    p = SamplingParams(temperature=1.0, seed=42)
    first = [sample(row, [p], [s])[0] for s in range(10)]
    again = [sample(row, [p], [s], Sampler(CPU, seed=9))[0] for s in range(10)]
    assert first == again


def test_different_seeds_differ() -> None:
    row = random_logits(1, seed=6, scale=0.3)
    a = [sample(row, [SamplingParams(temperature=1.0, seed=1)], [s])[0] for s in range(20)]
    b = [sample(row, [SamplingParams(temperature=1.0, seed=2)], [s])[0] for s in range(20)]
    assert a != b


def test_unseeded_rows_use_the_runner_generator() -> None:
    logits = random_logits(16, seed=7, scale=0.3)
    p = [SamplingParams(temperature=1.0)] * 16
    assert sample(logits, p, sampler=Sampler(CPU, 3)) == sample(logits, p, sampler=Sampler(CPU, 3))
    assert sample(logits, p, sampler=Sampler(CPU, 3)) != sample(logits, p, sampler=Sampler(CPU, 4))


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = logits_row.expand(n, -1).contiguous()
    tokens = torch.tensor(sample(logits, [params] * n, sampler=Sampler(CPU, 11)))
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / n


def test_temperature_distribution_is_plausible() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    freq = _frequencies(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(freq, probs, atol=0.02)
    freq = _frequencies(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(freq, torch.softmax(logits / 0.5, -1), atol=0.02)


def test_top_k_and_top_p_renormalise_the_kept_set() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.02)
    # 0.5 < 0.7, then 0.8 >= 0.7: the smallest set reaching top_p is the first two tokens.
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.02)
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.9, top_k=3))
    assert freq[3] == 0 and freq[2] > 0.1


def test_per_row_parameters_do_not_leak_between_rows() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)] * 2000
    out = torch.tensor(sample(logits, params))
    assert (out[0::2] == 0).all()
    assert (out[1::2] != 0).any()


def test_a_temperature_too_small_for_float32_samples_greedily():
    """1e-39 is 0 in float32: dividing by it would give NaN logits and token 0 every step."""
    logits = random_logits(16, seed=5)
    want = logits.argmax(dim=-1).tolist()
    for temperature in (1e-39, 1e-12, 9e-6):
        params = [SamplingParams(temperature=temperature)] * 16
        assert sample(logits, params) == want


# --- min_p, min_tokens, penalties -----------------------------------------------------------


def processed(logits: torch.Tensor, params: list[SamplingParams], *,
              token_ids: list[list[int]], num_prompt: list[int],
              eos: tuple[int, ...] = ()) -> torch.Tensor:
    batch = SamplingBatch.build(params, [len(t) - n for t, n in zip(token_ids, num_prompt, strict=True)],
                                logits.shape[-1], CPU, token_ids=token_ids,
                                num_prompt_tokens=num_prompt, eos_token_ids=eos)
    return Sampler.processed(logits.clone(), batch)


def test_min_p_keeps_only_tokens_near_the_top_one() -> None:
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.tensor([3.0, 2.9, 1.0, 0.5])     # p ~ .48 .44 .06 .04 (rest ~0)
    params = [SamplingParams(temperature=1.0, min_p=0.5)]
    probs = Sampler.probabilities(logits, SamplingBatch.build(params, [0], V, CPU))
    assert probs[0, 2:].sum().item() == 0.0 and abs(probs[0].sum().item() - 1.0) < 1e-6
    seen = {sample(logits, params, sampler=Sampler(CPU, seed=s))[0] for s in range(40)}
    assert seen == {0, 1}
    off = Sampler.probabilities(logits, SamplingBatch.build(
        [SamplingParams(temperature=1.0)], [0], V, CPU))
    assert off[0, 2].item() > 0.01                            # min_p 0: untouched


def test_min_tokens_bans_eos_and_stop_tokens_until_reached_even_when_greedy() -> None:
    logits = torch.zeros(2, V)
    logits[:, 2] = 9.0                                        # EOS would win
    logits[:, 7] = 8.0                                        # then the stop token
    params = [SamplingParams(min_tokens=3, stop_token_ids=(7,)),
              SamplingParams(min_tokens=3, stop_token_ids=(7,))]
    batch = SamplingBatch.build(params, [1, 3], V, CPU, eos_token_ids=(2,))
    tokens = Sampler(CPU)(logits, batch).tolist()
    assert tokens[0] not in (2, 7)                            # 1 output token < 3: banned
    assert tokens[1] == 2                                      # 3 reached: EOS allowed again


def test_penalties_follow_openai_and_hf_rules_per_row() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)] * 3)
    # prompt [0, 1], output [2, 2, 3]
    ids = [[0, 1, 2, 2, 3]] * 3
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=2.0),
              SamplingParams()]
    out = processed(logits, params, token_ids=ids, num_prompt=[2, 2, 2])
    # frequency x count + presence once, output tokens only (the prompt's 0 and 1 untouched)
    assert out[0, :4].tolist() == [2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25]
    # repetition: every seen token, prompt included: positive / 2, negative x 2
    assert out[1, :4].tolist() == [1.0, -4.0, 0.5, 0.25]
    assert out[1, 4:].eq(0.0).all()
    assert torch.equal(out[2], logits[2])                     # a row without penalties


def test_a_batch_without_the_new_parameters_is_the_batch_it_was() -> None:
    batch = SamplingBatch.build([SamplingParams(temperature=0.7)] * 2, [0, 5], V, CPU)
    assert batch.min_p is None and batch.banned == [] and batch.penalties is None
    logits = random_logits(2)
    assert Sampler.processed(logits, batch) is logits


def test_logprobs_are_the_raw_log_softmax_with_the_top_n_per_row() -> None:
    logits = random_logits(3)
    tokens = torch.tensor([5, 7, 9])
    out = Sampler.logprobs(logits, tokens, rows=[0, 2], top=[3, 0])
    want = logits.log_softmax(-1)
    assert len(out) == 2
    lp, ids, lps = out[0]
    assert abs(lp - want[0, 5].item()) < 1e-5
    assert ids == want[0].topk(3).indices.tolist()
    assert all(abs(a - b) < 1e-5 for a, b in zip(lps, want[0].topk(3).values.tolist(),
                                                  strict=True))
    assert out[1][1:] == ([], []) and abs(out[1][0] - want[2, 9].item()) < 1e-5
