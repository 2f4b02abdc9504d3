"""Prompt logprobs (vLLM's ``prompt_logprobs``) equal transformers' log-softmax over the same
prompt, whichever way the engine runs the prompt: in one step, chunked over several steps by a
small token budget, beside other requests, and after another request has put its prefix in the
prefix cache (the request asking for prompt logprobs recomputes it; the others still hit it)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import run_batch
from vconsole.engine.worker.tiny_model import ensure_tiny_model
from vconsole.shared.config import EngineConfig
from vconsole.tools.bench.quality import next_token_logprobs, reference_log_softmax
from vconsole.wire import protocol
from vconsole.wire.outputs import PromptLogprobs, RequestOutput
from vconsole.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def reference(model_dir: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                dtype=torch.float32).eval()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _core(model_dir: Any, **cfg: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                   block_size=8, **cfg))


def _ask(core: EngineCore, rid: str, ids: list[int], prompt_logprobs: int | None = TOP) -> Any:
    sp = SamplingParams(max_tokens=2, prompt_logprobs=prompt_logprobs)
    return core.make_request(rid, prompt_token_ids=ids, sampling=sp)


def _assert_matches(reference: Any, ids: list[int], got: PromptLogprobs | None) -> None:
    """Every position after the first: the token's logprob and rank and the top-3 as
    transformers' float32 log-softmax gives them."""
    assert got is not None
    lp = reference_log_softmax(reference, [ids])[0]
    want = next_token_logprobs(lp[None], [ids])[0]
    assert len(got) == len(ids) - 1
    torch.testing.assert_close(torch.tensor(got.token_logprobs), want, atol=1e-4, rtol=0)
    assert got.ranks == (lp >= want[:, None]).sum(-1).tolist()
    top_lp, top_ids = lp.topk(TOP, dim=-1)
    assert [row[:1] for row in got.top_ids] == top_ids[:, :1].tolist()
    torch.testing.assert_close(torch.tensor(got.top_logprobs), top_lp, atol=1e-4, rtol=0)
    assert got.entries()[0] is None and len(got.entries()) == len(ids)


@pytest.mark.parametrize(("budget", "blocks"), [(2048, None), (24, None), (24, 14)],
                         ids=["one-step", "chunked", "chunked-and-preempted"])
def test_prompt_logprobs_equal_transformers_however_the_prompt_runs(
        model_dir: Any, reference: Any, budget: int, blocks: int | None) -> None:
    long, short = _prompt(1, 90), _prompt(2, 17)
    core = _core(model_dir, max_num_batched_tokens=budget, num_kv_blocks=blocks)
    reqs = [_ask(core, "plain", _prompt(3, 40), None), _ask(core, "a", long),
            _ask(core, "b", short)]
    seen: list[dict[str, tuple[int, int, int]]] = []   # per step: preemptions, computed, scored

    def after_step(_done: int, _total: int) -> None:
        states = core.runner.requests
        seen.append({r.request_id: (r.num_preemptions, r.num_computed_tokens, len(
            states[r.request_id].prompt_logprobs or ()) if r.request_id in states else 0)
            for r in reqs[1:]})

    result = run_batch(core, reqs, on_progress=after_step)
    assert result.num_steps >= (90 // 24 if budget == 24 else 1)
    plain, a, b = result.outputs
    # 14 blocks of 8 hold 112 tokens of the 150: a prompt asking for its logprobs is taken
    # back mid-prefill, the logprobs of its first chunks already scored, and recomputed, its
    # logprobs started afresh.
    mid_prefill = [(rid, computed, scored) for before, now in zip(seen, seen[1:], strict=False)
                   for rid, (preempted, computed, scored) in before.items()
                   if now[rid][0] > preempted]
    assert bool(mid_prefill) == (blocks is not None)
    prompt_len = {"a": len(long), "b": len(short)}
    assert all(0 < computed < prompt_len[rid] and scored == computed
               for rid, computed, scored in mid_prefill), mid_prefill
    _assert_matches(reference, long, a.prompt_logprobs)
    _assert_matches(reference, short, b.prompt_logprobs)
    assert plain.prompt_logprobs is None
    assert all(len(t) == 2 for t in result.output_token_ids)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs_and_still_serves_others(
        model_dir: Any, reference: Any) -> None:
    core = _core(model_dir)
    shared = _prompt(4, 48)
    first = run_batch(core, [_ask(core, "warm", shared + _prompt(5, 6), None)])
    assert first.outputs[0].num_cached_tokens == 0
    ids = shared + _prompt(6, 9)
    kv = core.scheduler.kv
    queries, hits = kv.prefix_queries, kv.prefix_hits
    asked = run_batch(core, [_ask(core, "asks", ids)])
    assert asked.outputs[0].num_cached_tokens == 0          # the cache was not read
    # ... nor asked: the hit rate counts only requests that could have hit (as vLLM's)
    assert (kv.prefix_queries, kv.prefix_hits) == (queries, hits)
    _assert_matches(reference, ids, asked.outputs[0].prompt_logprobs)
    other = run_batch(core, [_ask(core, "other", shared + _prompt(7, 5), None)])
    assert other.outputs[0].num_cached_tokens == 48         # but it is still there for others
    assert (kv.prefix_queries, kv.prefix_hits) == (queries + len(shared) + 5, hits + 48)


def test_a_one_token_prompt_has_only_the_leading_none(model_dir: Any) -> None:
    core = _core(model_dir)
    out = run_batch(core, [_ask(core, "one", [42])]).outputs[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs.entries() == [None]


def test_run_batch_hands_back_the_prompts_and_every_tokens_logprobs(model_dir: Any) -> None:
    core = _core(model_dir)
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = run_batch(core, [core.make_request("r", prompt_token_ids=_prompt(9, 6),
                                             sampling=sp)]).outputs[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 5
    assert out.logprobs is not None and len(out.logprobs) == 5   # not only the last step's


def test_prompt_logprobs_cross_the_wire_once_and_a_bad_entry_is_refused() -> None:
    plp = PromptLogprobs([-1.5, -0.25], [3, 1], [[7, 9], [4, 2]], [[-0.5, -1.0], [-0.25, -2.0]])
    out = RequestOutput("r", [4], prompt_logprobs=plp)
    back = protocol.parse_outputs(protocol.decode(protocol.encode_outputs([out])))[0]
    assert back.prompt_logprobs == plp
    later = RequestOutput("r", [5])
    assert back.merged(later).prompt_logprobs == plp      # a slow reader still gets them
    assert protocol.parse_sampling({"prompt_logprobs": 2}, "r").prompt_logprobs == 2
    with pytest.raises(protocol.ProtocolError, match="prompt_logprobs must be"):
        protocol.parse_sampling({"prompt_logprobs": 21}, "r")
    bad = {"outputs": [{"request_id": "r", "new_token_ids": [4], "finished": False,
                        "prompt_logprobs": [[-1.0], [1], [[1, 2]], [[-1.0]]]}]}
    with pytest.raises(protocol.ProtocolError, match="differ in length"):
        protocol.parse_outputs(bad)


@pytest.mark.proc
def test_an_engine_process_sends_them_to_the_blocking_client(shared_engine: Any) -> None:
    from vconsole.engine.client.client import EngineClient

    ids = _prompt(8, 12)
    with EngineClient(shared_engine.endpoints["input"], shared_engine.endpoints["output"],
                      timeout_s=30) as c:
        done = c.generate(prompt_token_ids=ids, max_tokens=3, ignore_eos=True,
                          prompt_logprobs=2, timeout_s=60)
    assert done.finish_reason == "length" and len(done.output_token_ids) == 3
    plp = done.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) - 1
    assert all(len(top) == 2 and top[0] >= top[1] for top in plp.top_logprobs)
    assert all(lp <= top[0] + 1e-6 and (r > 1 or lp == pytest.approx(top[0]))
               for lp, r, top in zip(plp.token_logprobs, plp.ranks, plp.top_logprobs,
                                     strict=True))


def test_on_real_weights_chunked_prompt_logprobs_equal_transformers(
        smollm2_dir: Any, smollm2_hf: Any) -> None:
    from vconsole.tools.bench.quality import token_windows

    core = EngineCore(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32",
                                   max_num_batched_tokens=64, num_kv_blocks=16))
    windows = token_windows(core.tokenizer, 2, 96)        # real text, cut into 64-token chunks
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    result = run_batch(core, [core.make_request(f"w{i}", prompt_token_ids=w, sampling=sp)
                              for i, w in enumerate(windows)])
    lp = reference_log_softmax(smollm2_hf, windows)
    wants = next_token_logprobs(lp, windows)
    for out, ids, ref, want in zip(result.outputs, windows, lp, wants, strict=True):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids) - 1
        torch.testing.assert_close(torch.tensor(got.token_logprobs), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(got.top_logprobs)[:, 0], ref.max(-1).values,
                                   atol=1e-4, rtol=0)


def test_compute_logits_refuses_a_prompt_logprobs_request_and_the_reserve_covers_them(
        model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vconsole.engine.worker import prompt_logprobs

    core = _core(model_dir)
    core.add_request(_ask(core, "asks", _prompt(10, 12)))
    with pytest.raises(ValueError, match="compute_logits does not compute prompt logprobs"):
        core.runner.compute_logits(core.scheduler.schedule())
    # One step's memory reserve holds the prompt rows' float32 slices (~3 at once).
    reserve = core.runner._activation_reserve()
    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 0)
    assert reserve - core.runner._activation_reserve() == 256 * core.runner.vocab_size * 4 * 3
