"""The adaptive draft length (`vconsole.engine.spec.draft_length`): a request drafts the length
of its match expected to pay for the rows it adds, from the runner's measured step times and
its own record of accepted drafts; ``"draft_length": "fixed"`` drafts the whole match."""

from __future__ import annotations

import pytest

from vconsole.engine.spec.draft_length import PROBE_EVERY, DraftLength, StepCosts
from vconsole.shared.speculative import parse_speculative_config


def costs(per_row: float, widths: range = range(1, 9)) -> StepCosts:
    """Steps of 1 + ``per_row`` x (rows - 1) seconds (a few each, the median kept)."""
    c = StepCosts()
    for r in widths:
        for jitter in (0.9, 1.0, 1.1):
            c.observe(r, (1.0 + per_row * (r - 1)) * jitter)
    return c


def test_step_costs_are_medians_and_an_unmeasured_width_costs_the_narrower_one():
    c = StepCosts()
    assert c.time(1) is None
    for s in (0.010, 0.011, 0.030):
        c.observe(1, s)
    c.observe(4, 1.2)                               # one stalled step: not a price yet
    assert c.time(1) == pytest.approx(0.011)
    assert c.time(4) == pytest.approx(0.011)
    for s in (0.02, 0.021):
        c.observe(4, s)
    assert c.time(3) == pytest.approx(0.011)       # not measured: optimistic, so it is tried
    assert c.time(6) == pytest.approx(0.021)       # the median of 1.2, 0.02, 0.021


def test_a_request_whose_drafts_are_accepted_drafts_them_whole():
    length = DraftLength(4, costs(0.2))
    for _ in range(10):
        length.record("quote", 4, 4)
    assert length.choose("quote", 4, rows=1) == 4
    assert length.choose("quote", 2, rows=1) == 2       # never more than the match


def test_a_request_whose_drafts_fail_stops_drafting_but_probes():
    length = DraftLength(4, costs(0.2))
    for _ in range(12):
        length.record("chat", 4, 0)
    picks = [length.choose("chat", 4, rows=1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(0) == 2 * PROBE_EVERY - 2 and picks.count(1) == 2
    assert picks[PROBE_EVERY - 1] == 1


def test_the_length_follows_what_rows_cost():
    # Half of the first token accepted, a quarter of the first two, ...: worth one token when
    # rows are cheap, none when each row costs as much as a whole step.
    cheap, dear = DraftLength(4, costs(0.05)), DraftLength(4, costs(1.0))
    for length in (cheap, dear):
        for accepted in (0, 1, 0, 2, 0, 1, 3, 0) * 3:
            length.record("r", 4, accepted)
    assert cheap.choose("r", 4, rows=1) >= 2
    assert dear.choose("r", 4, rows=1) == 0
    # A step of 8 rows already gives 8 tokens a step: a draft's extra tokens must beat that
    # rate, not one token's, so it drafts less than alone (vLLM disables drafts by batch size
    # for the same reason).
    wide = DraftLength(4, costs(0.1, range(1, 17)))
    for accepted in (0, 1, 0, 2, 0, 1, 3, 0) * 3:
        wide.record("r", 4, accepted)
    assert 0 < wide.choose("r", 4, rows=8) < wide.choose("r", 4, rows=1)


def test_a_new_request_starts_from_every_requests_record_and_records_are_forgotten():
    length = DraftLength(4, costs(0.3))
    for i in range(20):
        length.record(f"old{i}", 4, 0)
    assert length.choose("new", 4, rows=1) == 0     # nobody's drafts were accepted
    length.record("new", 4, 4)
    length.forget({"new"})
    assert set(length._mine) == {"new"}


def test_before_any_step_time_and_when_fixed_the_whole_match_is_drafted():
    fresh = DraftLength(4, StepCosts())
    assert fresh.choose("r", 3, rows=1) == 3
    fixed = DraftLength(4, costs(1.0), adaptive=False)
    for _ in range(10):
        fixed.record("r", 4, 0)
    assert fixed.choose("r", 4, rows=1) == 4


def test_the_config_takes_draft_length_and_refuses_another_value():
    base = {"method": "ngram", "num_speculative_tokens": 3}
    assert parse_speculative_config(base).draft_length == "adaptive"
    fixed = parse_speculative_config({**base, "draft_length": "fixed"})
    assert fixed.draft_length == "fixed" and '"draft_length": "fixed"' in fixed.to_json()
    assert "draft_length" not in parse_speculative_config(base).to_json()   # vLLM's fields
    with pytest.raises(ValueError, match="draft_length must be one of adaptive, fixed"):
        parse_speculative_config({**base, "draft_length": "short"})


def test_a_new_request_is_judged_by_the_record_of_matches_as_long_as_its_own():
    # Across earlier requests 2-token matches were never right and 4-token ones always: a
    # new request (no record of its own) drafts only from a long match.
    length = DraftLength(4, costs(0.2))
    for i in range(12):
        length.record(f"old{i}", 4, 0, match=2)
        length.record(f"old{i}", 4, 4, match=4)
    assert length.choose("new", 4, rows=1, match=2) == 0
    assert length.choose("new", 4, rows=1, match=4) == 4


def test_the_proposer_says_how_long_its_match_was():
    from vconsole.engine.spec.ngram import NgramProposer
    p = NgramProposer(3, 2, 4)
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 4]) == [9, 2, 3] and p.match_len == 3
    assert p.propose([5, 6, 7, 8]) == [] and p.match_len == 0


def test_requests_drafting_in_one_step_see_each_others_rows():
    # Rows cost 0.1 of a step each up to 8, then the step runs the Python layers (x1.6): three
    # requests with good records, each given the rows of those before it, stay within 8 rows.
    c = StepCosts()
    for r in range(1, 17):
        for _ in range(3):
            c.observe(r, (1.0 + 0.1 * (r - 1)) * (1.6 if r > 8 else 1.0))
    length = DraftLength(4, c)
    for rid in ("a", "b", "c"):
        for _ in range(20):
            length.record(rid, 4, 3)
    rows = 3
    for rid in ("a", "b", "c"):
        rows += length.choose(rid, 4, rows)
    assert 3 < rows <= 8
