"""What a what-if says, as an operator reads it (`vconsole whatif`'s text and JSON): which
column is observed and which predicted, each variant's change against "predicted now", units
on every figure, and the baseline's own error per figure, with the predictions of a figure the
model misses on the baseline by more than its stated error marked as rough.

The traces are `make_trace`'s: made-up recorded figures (every first token 0.1 s after its
arrival, every gap 20 ms) over steps of a known cost, so the baseline misses some figures by
far more than the step-time model's error, as a trace recorded beside other work does."""

from __future__ import annotations

import copy

import pytest
from test_simulate import make_trace  # the simulator's hand-built trace

from vconsole.commands.whatif import format_report
from vconsole.telemetry.request_trace import FIGURES
from vconsole.whatif.predict import errors, pct, rough, rough_note, tolerance, whatif


@pytest.fixture(scope="module")
def report():
    return whatif(make_trace(), [{"max_num_seqs": 4}, {"num_kv_blocks": 32}])


def rows(text: str) -> dict[str, str]:
    """The table's rows of the first table, by their label."""
    out = {}
    for line in text.splitlines():
        for label in ("output tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50",
                      "preemptions", "KV peak, % pool", "KV peak, blocks"):
            if line.startswith(label) and label not in out:
                out[label] = line
    return out


# --- the numbers behind the words ---------------------------------------------------------------

def test_a_figure_is_rough_when_the_baseline_misses_it_by_more_than_the_models_error():
    error = {"output_tok_s": -0.004, "ttft_p50_s": 0.081, "ttft_p99_s": 0.68, "itl_p50_s": None,
             "itl_p99_s": -0.09}
    assert rough(error, 0.081) == ["ttft_p99_s", "itl_p99_s"]
    assert rough(error, 0.7) == []
    # compared as both are shown: +52.4% is "+52%", not beyond a stated "±52%" (0.523)
    assert tolerance(0.523) == "±52%" and pct(0.524) == "+52%"
    assert rough({"ttft_p99_s": 0.524}, 0.523) == []
    assert rough({"ttft_p99_s": 0.53}, 0.523) == ["ttft_p99_s"]


def test_percentages_are_signed_and_as_precise_as_they_matter():
    assert [pct(x) for x in (0.0, 0.0004, -0.005, 0.081, 0.68, 34.89, -0.3592, None)] == [
        "0%", "0%", "-0.5%", "+8.1%", "+68%", "+3,489%", "-36%", "-"]
    assert tolerance(0.081) == "±8.1%"
    assert rough_note("ttft_p99_s", 0.68) == ("TTFT p99 by +68%: treat predicted TTFT p99 as "
                                              "rough")


# --- the JSON: fields added, none taken away --------------------------------------------------------

def test_the_json_keeps_its_fields_and_adds_changes_rough_figures_and_blocks(report):
    base, variant = report["baseline"], report["variants"][0]
    assert set(base) >= {"config", "observed", "predicted", "error", "rough"}
    assert set(variant) >= {"set", "config", "predicted", "change", "change_rel", "rough"}
    # the baseline's own error, and the figures beyond the model's stated error
    assert base["error"] == errors(base["predicted"], base["observed"])
    assert base["rough"] == rough(base["error"], base["interval"]["stated"])
    assert "ttft_p99_s" in base["rough"] and variant["rough"] == base["rough"]
    # each change against predicted now, as a ratio (as before) and relative
    for k in FIGURES:
        if variant["change"][k] is not None:
            assert variant["change_rel"][k] == pytest.approx(variant["change"][k] - 1, abs=1e-4)
    assert variant["change_rel"]["ttft_p50_s"] > 0          # fewer seats: longer queues
    # the KV peak in blocks of each pool
    pool = report["variants"][1]["predicted"]
    assert pool["num_kv_blocks"] == 32 and 0 < pool["kv_peak_blocks"] <= 32
    assert pool["kv_usage_peak"] == pytest.approx(pool["kv_peak_blocks"] / 32, abs=1e-4)
    assert base["observed"]["num_kv_blocks"] == 64 and base["observed"]["kv_peak_blocks"] == 0


# --- the text ----------------------------------------------------------------------------------------

def test_the_columns_say_which_is_observed_which_predicted_and_what_changed(report):
    text = format_report(report)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    head = lines[lines.index("") + 1: lines.index("") + 4]
    joined = "\n".join(head)
    assert "observed" in joined and "predicted now" in joined
    assert "now vs" in joined and "predicted" in joined and "max_num_seqs=4" in joined
    assert "#1" not in text and "baseline  " not in text
    # the second variant is named too, in its own table beside predicted now
    assert "num_kv_blocks=32" in text
    assert "its % is against predicted now" in text


def test_every_figure_has_its_unit_and_the_kv_peak_is_a_share_of_the_pool_and_blocks(report):
    r = rows(format_report(report))
    base = report["baseline"]
    assert " ms" in r["ITL p50"] and (" s" in r["TTFT p99"] or " ms" in r["TTFT p99"])
    assert "100 ms" in r["TTFT p50"]                  # observed: 0.1 s after each arrival
    assert "0.0%" in r["KV peak, % pool"]
    assert f"{base['predicted']['kv_usage_peak']:.1%}" in r["KV peak, % pool"]
    assert "0/64" in r["KV peak, blocks"]
    assert f"{base['predicted']['kv_peak_blocks']}/64" in r["KV peak, blocks"]
    assert "0.9" not in r["KV peak, % pool"].split()  # never a bare fraction


def test_each_variant_shows_its_change_against_predicted_now(report):
    r = rows(format_report(report))
    change = report["variants"][0]["change_rel"]["itl_p50_s"]
    assert pct(change) in r["ITL p50"]


def test_the_baselines_error_is_beside_each_figure_and_rough_ones_are_said_plainly(report):
    text = format_report(report)
    r = rows(text)
    base, model = report["baseline"], report["model"]
    assert pct(base["error"]["ttft_p99_s"]) in r["TTFT p99"]
    assert "ttft_p99_s" in base["rough"]
    assert r["TTFT p99"].count("!") == 2              # predicted now, and the variant
    assert "!" not in r["preemptions"]                # 0 observed, 0 predicted: no miss
    stated = base["interval"]["stated"]["ttft_p99_s"]
    assert "! the model misses the baseline by more than its stated error on:" in text
    assert (f"  TTFT p99 by {pct(base['error']['ttft_p99_s'])}, stated {tolerance(stated)}: "
            f"treat predicted TTFT p99 as rough") in text.splitlines()
    assert f"median error {tolerance(model['rel_error'])} per step" in text


def test_a_baseline_within_the_models_error_carries_no_mark(report):
    calm = copy.deepcopy(report)
    calm["baseline"]["rough"] = []
    text = format_report(calm)
    assert "!" not in text and "rough" not in text
    assert pct(calm["baseline"]["error"]["ttft_p99_s"]) in rows(text)["TTFT p99"]


def test_many_variants_and_validated_figures_still_fit_80_columns(report):
    wide = whatif(make_trace(), [{"max_num_seqs": 4}, {"num_kv_blocks": 32, "policy": "fcfs"},
                                 {"max_num_batched_tokens": 64}, {"block_size": 32}])
    for entry in (wide["baseline"], *wide["variants"]):     # as --validate fills them
        entry["validated"] = dict(entry["predicted"], ttft_p99_s=1.5)
        entry["validation_error"] = errors(entry["predicted"], entry["validated"])
    text = format_report(wide)
    assert max(map(len, text.splitlines())) <= 80
    assert "real engine" in text and "max_num_batched_tokens=64" in text
    assert text.count("predicted now") >= 2               # each further table beside it
    assert pct(wide["baseline"]["validation_error"]["ttft_p99_s"]) in text


def test_a_csv_trace_says_nothing_checks_its_baseline():
    csv = make_trace()
    csv.header.source = "csv"
    csv.steps = []
    text = format_report(whatif(csv, [{"max_num_seqs": 4}], costs=make_trace()))
    assert "nothing checks the baseline" in text
    assert "observed" not in rows(text)["TTFT p99"] and "!" not in text
