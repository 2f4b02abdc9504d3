"""Constrained decoding on real forwards of the built-in ``tiny`` model (random weights: its
text is noise, and constrained output must still parse — that is the point).

One core serves most tests (a core costs seconds on a shared machine); the preemption test
has its own with a tiny KV pool; the engine-process test uses the session's shared engine.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from vconsole.engine.core import EngineCore
from vconsole.engine.offline import run_batch
from vconsole.engine.publish.request_rows import RequestRows
from vconsole.engine.request import RequestStatus
from vconsole.engine.structured import manager as manager_module
from vconsole.engine.structured.compiler import GrammarCompiler
from vconsole.engine.structured.grammar import to_grammar
from vconsole.engine.worker import model_runner
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams, StructuredSpec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'


def spec_json(schema: dict[str, Any] = SCHEMA) -> StructuredSpec:
    return StructuredSpec("json", json.dumps(schema))


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                   max_num_seqs=16, num_kv_blocks=256, block_size=8))


def sampled(core: EngineCore, specs: list[StructuredSpec | None], *, max_tokens: int = 160,
            temperature: float = 1.0, **kw: Any) -> list[Any]:
    reqs = [core.make_request(f"r{time.monotonic_ns()}-{i}", prompt="the answer:",
                              sampling=SamplingParams(max_tokens=max_tokens,
                                                      temperature=temperature, seed=i,
                                                      structured=spec, **kw))
            for i, spec in enumerate(specs)]
    result = run_batch(core, reqs)
    for out, tokens in zip(result.outputs, result.output_token_ids, strict=True):
        out.new_token_ids = tokens     # every token, not the last output's delta
    return result.outputs


def accepted(core: EngineCore, spec: StructuredSpec, token_ids: list[int]) -> bool:
    """A fresh matcher takes every token of the output (its prefix is in the language)."""
    tok = core.structured.compiler._tokenizer.result()
    m = LLMatcher(tok, to_grammar(spec), log_level=0)
    return all(m.consume_token(t) for t in token_ids)


def test_json_schema_outputs_parse_and_validate(core: EngineCore) -> None:
    outs = sampled(core, [spec_json()] * 4)
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text, out.error)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert out.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_regex_choice_and_gbnf(core: EngineCore) -> None:
    specs = [StructuredSpec("regex", REGEX)] * 3 + [StructuredSpec("choice",
                                                                   json.dumps(CHOICES))] * 3 \
        + [StructuredSpec("grammar", GBNF)] * 3
    outs = sampled(core, specs, max_tokens=200)
    for out, spec in zip(outs, specs, strict=True):
        assert out.finish_reason == "stop", (spec.kind, out.text, out.error)
        if spec.kind == "regex":
            assert re.fullmatch(REGEX, out.text)
        elif spec.kind == "choice":
            assert out.text in CHOICES
        else:
            assert re.fullmatch(r"\((0|[1-9][0-9]?)(\+(0|[1-9][0-9]?))*\)", out.text)


def test_json_object_and_greedy_rows_stay_in_the_language(core: EngineCore) -> None:
    spec = StructuredSpec("json_object", "")
    outs = sampled(core, [spec] * 3 + [StructuredSpec("regex", REGEX)], max_tokens=60,
                   temperature=0.0)
    for out in outs[:3]:
        # Noise may run past max_tokens inside a string; whatever it wrote is a JSON prefix.
        assert accepted(core, spec, out.new_token_ids), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")
    assert re.fullmatch(REGEX, outs[3].text)


def test_constrained_and_free_rows_share_a_batch_with_logprobs(core: EngineCore) -> None:
    outs = sampled(core, [StructuredSpec("choice", json.dumps(CHOICES)), None,
                          StructuredSpec("regex", REGEX), None], max_tokens=12, logprobs=2)
    assert outs[0].text in CHOICES and re.fullmatch(REGEX, outs[2].text)
    assert outs[1].finish_reason == outs[3].finish_reason == "length"
    for out in outs:   # logprobs of the masked logits: the sampled token's is finite
        assert out.logprobs is not None
        assert all(lp > float("-inf") for lp, _ids, _lps in out.logprobs)
        # ... and a top list holds no token the grammar forbids (none at -inf)
        assert all(v > float("-inf") for _lp, _ids, lps in out.logprobs for v in lps)
    # a choice allows one token at most places: its top-2 lists are often shorter
    assert any(len(ids) < 2 for _lp, ids, _lps in outs[0].logprobs)


def test_a_spec_that_does_not_compile_finishes_with_error_and_nothing_else_changes(
        core: EngineCore) -> None:
    bad = StructuredSpec("json", '{"type": "object", "properties": {"a": {"type": "strin"}}}')
    outs = sampled(core, [bad, StructuredSpec("regex", REGEX), None, bad], max_tokens=8)
    for out in (outs[0], outs[3]):
        assert out.finish_reason == "error" and out.new_token_ids == []
        assert out.error is not None and out.error.startswith("structured output: ")
        assert "strin" in out.error
        assert "\n" not in out.error and len(out.error) < 300   # no parser state, no grammar
    assert re.fullmatch(REGEX, outs[1].text) and len(outs[2].new_token_ids) == 8
    before = core.structured.compiler.num_errors
    sampled(core, [bad], max_tokens=8)    # cached: the same error at once, no new compile
    assert core.structured.compiler.num_errors == before
    assert not core.structured.active and not core.structured.num_compiling


def test_compiles_are_cached_by_spec_and_counted(core: EngineCore) -> None:
    spec = StructuredSpec("regex", "[0-9]{4}")
    compiler = core.structured.compiler
    compiles, hits = compiler.num_compiles, compiler.num_cache_hits
    outs = sampled(core, [spec] * 4, max_tokens=10)
    assert all(re.fullmatch("[0-9]{4}", o.text) for o in outs)
    assert compiler.num_compiles == compiles + 1 and compiler.num_cache_hits == hits + 3
    stats = core.scheduler_stats(0)
    assert stats.structured_compiles_total == compiler.num_compiles
    assert stats.structured_compile_cache_hits_total == compiler.num_cache_hits
    assert stats.structured_compile_seconds_total > 0


def test_an_unconstrained_batch_runs_no_structured_code(core: EngineCore, monkeypatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("structured-output code ran for an unconstrained batch")

    monkeypatch.setattr(manager_module.StructuredOutputs, "fill", boom)
    monkeypatch.setattr(manager_module.StructuredOutputs, "advance", boom)
    monkeypatch.setattr(model_runner, "apply_grammar", boom)
    reqs = [core.make_request(f"free{i}", prompt_token_ids=[5 + i, 6, 7],
                              sampling=SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(4)]
    result = run_batch(core, reqs, keep_step_log=True)
    assert all(len(t) == 5 for t in result.output_token_ids)
    assert all(s.structured_ns == 0 for s in result.step_log)


def test_structured_phase_is_timed_and_phases_add_up(core: EngineCore) -> None:
    reqs = [core.make_request(f"t{i}", prompt="x", sampling=SamplingParams(
        max_tokens=20, temperature=1.0, seed=i, structured=spec_json())) for i in range(3)]
    result = run_batch(core, reqs, keep_step_log=True)
    steps = [s for s in result.step_log if s.num_reqs]
    assert any(s.structured_ns > 0 for s in steps)
    for s in steps:
        assert s.schedule_ns + s.execute_ns + s.structured_ns + s.update_ns == s.total_ns


def test_a_compiling_request_never_delays_another(core: EngineCore, monkeypatch) -> None:
    """A grammar that takes 1.5 s to compile (the compile replaced by a slow one: only the
    timing is fake) while a free request decodes: its steps go on, the constrained request
    is visible as compiling, then runs and is valid."""
    real = GrammarCompiler.build_matcher

    def slow(tokenizer: Any, grammar: str) -> LLMatcher:
        time.sleep(1.5)
        return real(tokenizer, grammar)

    monkeypatch.setattr(GrammarCompiler, "build_matcher", staticmethod(slow))
    spec = StructuredSpec("regex", "[a-z]{2}[0-9]{7}")    # not compiled before: no cache hit
    held = core.make_request("held", prompt="x", sampling=SamplingParams(
        max_tokens=20, structured=spec))
    free = core.make_request("free", prompt="x", sampling=SamplingParams(max_tokens=12))
    assert core.add_request(held) is None and core.add_request(free) is None
    assert held.status is RequestStatus.COMPILING
    stats = core.scheduler_stats(10, RequestRows())
    assert stats.num_compiling == 1
    rows = {r.id: r for r in stats.requests}
    assert rows["held"].state == "compiling" and rows["held"].constraint == spec.code
    assert rows["free"].constraint == 0
    t0 = time.monotonic()
    steps: list[float] = []
    text: list[int] = []
    while core.has_unfinished_requests():
        if not core.has_ready_requests():
            assert core.structured.wait_ready(5.0)
            continue
        s0 = time.monotonic()
        outputs, _ = core.step()
        steps.append(time.monotonic() - s0)
        for out in outputs.get(b"", []):
            if out.request_id == "free" and out.finished:
                free_done = time.monotonic() - t0
            if out.request_id == "held":
                text += out.new_token_ids
    assert free_done < 1.5, "the free request waited for the other one's grammar"
    assert max(steps) < 1.0, f"a step waited for the compile: {max(steps):.2f} s"
    assert held.finish_reason == "stop" and held.compile_ms >= 1400
    assert re.fullmatch("[a-z]{2}[0-9]{7}", core.detokenize(text))


def test_an_aborted_compiling_request_finishes_once(core: EngineCore) -> None:
    spec = StructuredSpec("regex", "[a-z]{2}x[0-9]{3}")
    req = core.make_request("gone", prompt="x", sampling=SamplingParams(
        max_tokens=8, structured=spec))
    assert core.add_request(req) is None
    core.abort_requests(["gone"])
    outputs, _ = core.step()
    assert [o.finish_reason for o in outputs[b""]] == ["abort"]
    assert core.structured.wait_ready(5.0)
    core.step()
    assert not core.has_unfinished_requests() and not core.structured.active


def test_an_id_reused_while_its_first_compile_runs_waits_for_its_own(core: EngineCore,
                                                                      monkeypatch) -> None:
    """Aborted while compiling, the same id comes back with another spec: the first compile's
    end must not hand over the second (whose compile still runs), nor block a step on it."""
    real = GrammarCompiler.build_matcher

    def slow(tokenizer: Any, grammar: str) -> LLMatcher:
        time.sleep(0.6 if "first" in grammar else 1.5)
        return real(tokenizer, grammar)

    monkeypatch.setattr(GrammarCompiler, "build_matcher", staticmethod(slow))
    first = core.make_request("again", prompt="x", sampling=SamplingParams(
        max_tokens=8, structured=StructuredSpec("regex", "first[0-9]{2}")))
    assert core.add_request(first) is None
    core.abort_requests(["again"])
    core.step()
    second = core.make_request("again", prompt="x", sampling=SamplingParams(
        max_tokens=12, structured=StructuredSpec("regex", "second[a-c]{3}")))
    assert core.add_request(second) is None
    assert core.structured.wait_ready(5.0)       # the first compile's end
    t0 = time.monotonic()
    core.step()
    assert time.monotonic() - t0 < 0.5, "a step waited for the second compile"
    assert second.status is RequestStatus.COMPILING
    text: list[int] = []
    while core.has_unfinished_requests():
        if not core.has_ready_requests():
            assert core.structured.wait_ready(5.0)
            continue
        outputs, _ = core.step()
        text += [t for o in outputs.get(b"", []) for t in o.new_token_ids]
    assert second.finish_reason == "stop"
    assert re.fullmatch("second[a-c]{3}", core.detokenize(text))


def test_close_drops_the_compiles_still_queued(monkeypatch) -> None:
    """Shutting down waits for no queued compile (the threads run what they hold only)."""
    compiler = GrammarCompiler(lambda: None)    # type: ignore[arg-type, return-value]
    running: list[str] = []

    def slow(tok: Any, grammar: str) -> None:
        running.append(grammar)
        time.sleep(1.0)                                 # still running when close comes

    monkeypatch.setattr(GrammarCompiler, "build_matcher", staticmethod(slow))
    futures = [compiler.submit(StructuredSpec("regex", f"q{i}"))[0] for i in range(4)]
    deadline = time.monotonic() + 30
    while len(running) < 2:                             # the first two are running
        assert time.monotonic() < deadline, running
        time.sleep(0.01)
    compiler.close()
    assert sum(f.cancelled() for f in futures) == 2     # two threads: two were running


def test_preemption_and_recompute_keep_outputs_valid() -> None:
    """A pool of 12 blocks of 4 tokens for 6 requests that each need 5+ blocks: requests are
    preempted and recomputed again and again; their matchers must neither skip nor consume a
    token twice, so every output still matches."""
    core = EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                   num_kv_blocks=12, block_size=4, max_num_seqs=6))
    pattern = "[a-z]{4}-[0-9]{4}-[a-z]{3}"
    specs = [StructuredSpec("regex", pattern)] * 3 + [StructuredSpec("choice", json.dumps(
        ["alpha beta gamma", "delta epsilon zeta"]))] * 3
    reqs = [core.make_request(f"p{i}", prompt="xx", sampling=SamplingParams(
        max_tokens=30, temperature=1.0, seed=i, structured=spec))
        for i, spec in enumerate(specs)]
    outs = run_batch(core, reqs).outputs
    assert sum(o.num_preemptions for o in outs) >= 3, [o.num_preemptions for o in outs]
    for out, spec in zip(outs, specs, strict=True):
        assert out.finish_reason == "stop", (out.text, out.error)
        if spec.kind == "regex":
            assert re.fullmatch(pattern, out.text)
        else:
            assert out.text in ("alpha beta gamma", "delta epsilon zeta")


@pytest.mark.proc
def test_through_the_engine_process(shared_engine: Any) -> None:
    """The wire and the busy loop: only compiling requests in the engine, then the wake-up."""
    from vconsole.engine.client.client import EngineClient

    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["n"], "additionalProperties": False}
    with EngineClient(shared_engine.endpoints["input"], shared_engine.endpoints["output"],
                      timeout_s=30) as c:
        done = c.generate(prompt="hi", max_tokens=30, temperature=1.0, seed=3,
                          structured=StructuredSpec("json", json.dumps(small)), timeout_s=60)
        bad = c.generate(prompt="hi", max_tokens=5, timeout_s=60,
                         structured={"kind": "regex", "value": "[a-"})
    assert done.finish_reason == "stop", (done.text, done.error)
    jsonschema.validate(json.loads(done.text), small)
    assert bad.finish_reason == "error" and bad.error.startswith("structured output: ")


def test_a_bitmask_filled_beside_the_forward_is_awaited(core: EngineCore,
                                                        monkeypatch) -> None:
    """The GPU path (fill on a thread while the forward runs), forced on the CPU: the runner
    waits for the fill, so outputs are as valid; the fill itself made slow to prove the wait."""
    real = manager_module.StructuredOutputs._fill_rows

    def slow_fill(self: Any, matchers: Any, bitmask: Any) -> None:
        time.sleep(0.01)
        real(self, matchers, bitmask)

    monkeypatch.setattr(manager_module.StructuredOutputs, "_fill_rows", slow_fill)
    monkeypatch.setattr(core, "overlap_bitmask", True)
    specs = [StructuredSpec("regex", REGEX), StructuredSpec("choice", json.dumps(CHOICES)),
             None, StructuredSpec("grammar", GBNF)]
    outs = sampled(core, specs, max_tokens=40)
    assert re.fullmatch(REGEX, outs[0].text) and outs[1].text in CHOICES
    assert outs[3].finish_reason == "stop" and outs[3].text.startswith("("), outs[3].text


def test_llguidances_thread_pool_fills_the_same_masks_as_row_by_row(core: EngineCore,
                                                                    monkeypatch) -> None:
    """Machines with 4 cores or more fill the bitmask with llguidance's executor (one call for
    every row); here it is forced on, and each row's mask must equal the one-by-one fill's."""
    specs = [StructuredSpec("regex", REGEX), StructuredSpec("choice", json.dumps(CHOICES)),
             spec_json(), StructuredSpec("grammar", GBNF)]
    compiled = [core.structured.compiler.submit(s)[0].result() for s in specs]
    matchers = [(c.matcher.deep_copy(), row) for row, c in enumerate(compiled)]
    assert matchers[2][0].consume_tokens(  # inside a string: a mask unlike the others
        core.tokenizer.encode('{"name":"ab', add_special_tokens=False))
    words = (core.structured.compiler.vocab_size + 31) // 32
    one_by_one = torch.zeros((len(specs) + 2, words), dtype=torch.int32)
    together = torch.zeros_like(one_by_one)
    monkeypatch.setattr(manager_module, "PAR_MIN_ROWS", 1 << 30)
    core.structured._fill_rows(matchers, one_by_one[:len(specs)])
    monkeypatch.setattr(manager_module, "PAR_MIN_ROWS", 2)
    core.structured._fill_rows(matchers, together[:len(specs)])
    assert torch.equal(one_by_one, together)
    assert all(one_by_one[r].any() for r in range(len(specs)))   # every row allows something
    assert not one_by_one[len(specs):].any()                      # and nothing past the rows
    assert not torch.equal(one_by_one[0], one_by_one[1])


def test_a_bitmask_llguidance_could_write_past_is_refused(core: EngineCore) -> None:
    """llguidance writes the masks to raw memory: a row past the tensor, a view with gaps or
    another dtype would be written over blindly, so the fill refuses them first."""
    matcher = core.structured.compiler.submit(StructuredSpec("regex", REGEX))[0].result().matcher
    words = (core.structured.compiler.vocab_size + 31) // 32
    ok = torch.zeros((2, words), dtype=torch.int32)
    for matchers, bitmask in (([(matcher, 2)], ok), ([(matcher, -1)], ok),
                              ([(matcher, 0)], ok.to(torch.int64)),
                              ([(matcher, 0)], torch.zeros((2, 2 * words), dtype=torch.int32)[:, ::2])):
        with pytest.raises(ValueError, match="contiguous CPU int32"):
            core.structured._fill_rows(matchers, bitmask)
    assert not ok.any()
    core.structured._fill_rows([(matcher, 1)], ok)
    assert ok[1].any() and not ok[0].any()
