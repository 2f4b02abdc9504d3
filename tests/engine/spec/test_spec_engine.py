"""Speculative decoding on the real engine core (the tiny random Llama, real forwards).

The tiny model's weights are random, so it rarely repeats its prompt and the n-gram lookup
rarely guesses right; to exercise acceptance the tests also hand the scheduler drafts
themselves (``Request.spec_token_ids``, exactly where the runner's proposals land): the greedy
reference's own next tokens (all accepted), a wrong token after two right ones (cut there),
or wrong tokens (all rejected). Everything else — scheduling the draft row, one forward over
it, verification, rollback, the counters — is the engine's own path.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import make_core
from vconsole.engine.request import Request
from vconsole.engine.sched.output import ModelRunnerOutput
from vconsole.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}')
MAX_TOKENS = 12
_rng = random.Random(7)
_BASE = [_rng.randrange(3, 250) for _ in range(24)]
PROMPTS = [_BASE + _BASE[:12], [_rng.randrange(3, 250) for _ in range(9)], _BASE[5:] * 2]

Drafts = Callable[[Request, list[int]], list[int] | None]


def _core(spec: str | None = SPEC, **cfg) -> EngineCore:
    return make_core(model="tiny", device="cpu", dtype="float32",
                     speculative_config=spec, **{"num_kv_blocks": 128, **cfg})


def _run(core: EngineCore, prompts, sampling: list[SamplingParams] | None = None,
         drafts: Drafts | None = None, reference: list[list[int]] | None = None):
    """Step until every request finishes; ``drafts(req, its reference)`` sets each running
    request's draft before each step. Returns (token ids, finish reasons) in prompt order."""
    reqs = []
    for i, ids in enumerate(prompts):
        sp = sampling[i] if sampling else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                         ignore_eos=True)
        reqs.append(core.make_request(f"r{i}", prompt_token_ids=list(ids), sampling=sp))
        assert core.add_request(reqs[-1]) is None
    reasons: dict[str, str | None] = {}
    while core.has_unfinished_requests():
        if drafts is not None:
            for req in core.scheduler.running:
                if req.output_token_ids:
                    d = drafts(req, reference[int(req.request_id[1:])] if reference else [])
                    if d is not None:
                        req.spec_token_ids = d
        outputs, _ = core.step()
        for outs in outputs.values():
            for out in outs:
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
    return [r.output_token_ids for r in reqs], [reasons[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    tokens, _ = _run(_core(spec=None), PROMPTS)
    return tokens


def _right(req: Request, ref: list[int]) -> list[int]:
    n = len(req.output_token_ids)
    return ref[n:n + 3]


def _two_right_then_wrong(req: Request, ref: list[int]) -> list[int]:
    d = _right(req, ref)
    if len(d) == 3:
        d[2] = (d[2] + 1) % 250
    return d


def _wrong(req: Request, ref: list[int]) -> list[int]:
    return [(t + 1) % 250 for t in _right(req, ref)]


def test_greedy_output_is_identical_with_the_engines_own_drafts(reference):
    core = _core()
    tokens, _ = _run(core, PROMPTS)
    assert tokens == reference
    s = core.scheduler
    assert s.spec_num_drafts > 0        # the repeated prompts gave the lookup something
    assert s.spec_num_accepted_tokens == sum(s.spec_accepted_per_pos)


@pytest.mark.parametrize("drafts, accepted_per_draft", [
    (_right, None), (_two_right_then_wrong, 2), (_wrong, 0)])
def test_greedy_output_is_identical_and_counted_whatever_the_draft(reference, drafts,
                                                                   accepted_per_draft):
    core = _core()
    tokens, reasons = _run(core, PROMPTS, drafts=drafts, reference=reference)
    assert tokens == reference
    assert set(reasons) == {"length"}
    s = core.scheduler
    assert s.spec_num_drafts > 0
    assert s.spec_num_accepted_tokens == sum(s.spec_accepted_per_pos)
    assert s.spec_accepted_per_pos[0] <= s.spec_num_drafts
    if accepted_per_draft is None:      # every drafted token was right
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
        assert s.spec_accepted_per_pos[0] == s.spec_num_drafts
        # 1 + 3 tokens per step: far fewer steps than tokens
        assert core.num_steps < len(PROMPTS) * MAX_TOKENS // 2
    elif accepted_per_draft == 0:
        assert s.spec_num_accepted_tokens == 0
    else:                               # drafts of 3 lose their third; shorter ones are right
        assert s.spec_accepted_per_pos[2] == 0
        assert s.spec_accepted_per_pos[1] > 0


def test_stop_token_and_max_tokens_hold_when_several_tokens_come_at_once(reference):
    ref = reference[0]
    stop = ref[3]
    first = ref.index(stop)
    sps = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                          stop_token_ids=(stop,)),
           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    core = _core()
    tokens, reasons = _run(core, PROMPTS[:2], sampling=sps, drafts=_right, reference=reference)
    assert tokens[0] == ref[:first + 1] and reasons[0] == "stop"
    assert tokens[1] == reference[1][:3] and reasons[1] == "length"
    plain, plain_reasons = _run(_core(spec=None), PROMPTS[:2], sampling=sps)
    assert (plain, plain_reasons) == (tokens, reasons)


def test_a_rejected_draft_leaves_the_cache_as_if_never_written(reference):
    """Block size 4: the rejected draft's positions fill a block of their own. Afterwards the
    next step's logits equal those of an engine that never speculated, the pool counts the
    same tokens, and the prefix cache registered the same blocks (none holding a draft)."""
    prompt = PROMPTS[1][:7]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cores = {"spec": _core(block_size=4), "plain": _core(spec=None, block_size=4)}
    for name, core in cores.items():
        req = core.make_request("x", prompt_token_ids=prompt, sampling=sp)
        core.add_request(req)
        core.step()                             # the prompt: 7 positions, one token out
        if name == "spec":
            req.spec_token_ids = [5, 6, 7, 8]   # not the model's next tokens (checked below)
        core.step()                             # spec: 5 positions, 4 rejected
        assert req.num_computed_tokens == 8 and len(req.output_token_ids) == 2
    spec, plain = cores["spec"], cores["plain"]
    assert spec.scheduler.spec_num_drafts == 1 and spec.scheduler.spec_num_accepted_tokens == 0
    rs, rp = spec.scheduler.get_request("x"), plain.scheduler.get_request("x")
    assert rs.output_token_ids == rp.output_token_ids
    assert rs.output_token_ids[1] != 5
    ks, kp = spec.scheduler.kv, plain.scheduler.kv
    assert ks.kv_stats().token_usage * ks.num_blocks == kp.kv_stats().token_usage * kp.num_blocks
    ts, tp = ks.get_block_ids("x"), kp.get_block_ids("x")
    assert [ks.pool.block_hash(b) for b in ts[:2]] == [kp.pool.block_hash(b) for b in tp[:2]]
    assert ks.pool.block_hash(ts[2]) is None    # the drafts' block: never offered to the cache
    logits = {}
    rs.spec_token_ids = []                      # a plain decode next, in both
    for name, core in cores.items():
        so = core.scheduler.schedule()
        assert so.num_scheduled_tokens == {"x": 1}
        logits[name] = core.runner.compute_logits(so)["x"]
        core.scheduler.update_from_output(
            so, ModelRunnerOutput(sampled={"x": int(logits[name].argmax())}))
    torch.testing.assert_close(logits["spec"], logits["plain"], rtol=1e-5, atol=1e-5)


def test_sampled_requests_speculate_and_finish(reference):
    sps = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, ignore_eos=True),
           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)]
    core = _core()
    tokens, reasons = _run(core, PROMPTS, sampling=sps, drafts=_right, reference=reference)
    assert [len(t) for t in tokens] == [MAX_TOKENS] * 3 and set(reasons) == {"length"}
    assert tokens[2] == reference[2]
    assert core.scheduler.spec_num_drafts > 0


def test_speculation_pauses_and_resumes_with_the_hot_key(reference):
    core = _core()
    assert core.apply_config({"speculative_decoding": False}).applied
    tokens, _ = _run(core, PROMPTS, drafts=_right, reference=reference)
    assert tokens == reference
    assert core.scheduler.spec_num_drafts == 0
    so = core.scheduler.schedule()
    assert not so.propose_drafts
    assert core.apply_config({"speculative_decoding": True}).applied
    tokens, _ = _run(core, [PROMPTS[0]], drafts=_right, reference=reference)
    assert tokens == reference[:1] and core.scheduler.spec_num_drafts > 0


def test_drafts_take_only_what_every_plain_row_left():
    """A guess never takes another running row's token: with a budget of 8 and four decode
    rows each holding a 3-token draft, all four decode (as without speculation) and the drafts
    share the 4 tokens left; it used to give r0 and r1 4 tokens each and r2, r3 none."""
    core = _core(max_num_batched_tokens=8, max_num_seqs=4)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(f"r{i}", prompt_token_ids=[10 + i, 20 + i, 30 + i], sampling=sp)
            for i in range(4)]
    for r in reqs:
        core.add_request(r)
    while not all(r.output_token_ids for r in reqs):
        core.step()
    for r in reqs:
        r.spec_token_ids = [1, 2, 3]
    so = core.scheduler.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1", "r2", "r3"}
    assert sum(so.num_scheduled_tokens.values()) == 8
    drafted = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
    assert drafted == 4 and all(so.num_scheduled_tokens[r] == 1 + len(d)
                                for r, d in so.scheduled_spec_decode_tokens.items())


@pytest.mark.parametrize("spec", [None, SPEC])
def test_a_draft_never_preempts_another_request(spec):
    """Five blocks of 4: r1 (7 tokens, a slot left in its block) drafts 3 tokens while r2
    (8 tokens) needs a new block for its next token. The draft may not take the one free
    block: no preemption, with speculation as without (it used to preempt r2)."""
    core = _core(spec, num_kv_blocks=5, block_size=4, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    r1 = core.make_request("r1", prompt_token_ids=[11, 12, 13, 14, 15, 16, 17], sampling=sp)
    r2 = core.make_request("r2", prompt_token_ids=[21, 22, 23, 24, 25, 26, 27, 28], sampling=sp)
    core.add_request(r1)
    core.add_request(r2)
    core.step()
    assert r1.num_computed_tokens == 7 and r2.num_computed_tokens == 8
    if spec:
        r1.spec_token_ids = [1, 2, 3]
    core.step()
    assert core.scheduler.num_preemptions_total == 0
    assert len(r1.output_token_ids) >= 2 and len(r2.output_token_ids) == 2


def test_the_runner_gives_the_draft_length_its_step_costs_and_every_verified_draft():
    core = _core()
    _run(core, PROMPTS)
    drafts, sched = core.runner.drafts, core.scheduler
    assert drafts is not None and sched.spec_num_drafts > 0
    # Every verified draft recorded, at the length it was scheduled with.
    record = drafts.length.all
    assert record.tries[0] == sched.spec_num_drafts
    assert sum(record.tries) == sched.spec_num_draft_tokens
    # Step costs only from steps of decode (and draft) rows: never a prompt's chunk.
    widths = set(drafts.costs._times)
    assert widths and max(widths) <= len(PROMPTS) * 4
