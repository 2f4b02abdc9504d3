"""`vconsole bench structured` on the tiny model: every constrained output parses and validates
against its schema, both sides computed the same tokens, and the JSON carries every figure
docs/benchmarks.md quotes. Timings are not judged (shared cores)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from vconsole.tools.bench.structured_schemas import SCHEMAS, heavy_schema, typical_schema
from vconsole.tools.bench.structured_validity import check_output


@pytest.mark.proc
@pytest.mark.long           # make test-long (25-35 s); the engine's tests cover what it measures
def test_bench_structured_on_tiny_validates_every_constrained_output() -> None:
    proc = subprocess.run([sys.executable, "-m", "vconsole", "bench", "structured", "--model",
                           "tiny", "--num-requests", "4", "--concurrency", "2", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"] == "tiny" and out["num_requests"] == 4
    level = out["concurrency"]["2"]
    assert level["validity"]["valid_rate"] == 1.0 == out["valid_rate"], level["validity"]
    constrained, free = level["constrained"], level["unconstrained"]
    assert constrained["output_tokens"] == free["output_tokens"] > 0      # the same work
    assert set(constrained["finish_reasons"]) == {"stop"}                 # the grammar ended
    assert level["ratio"] == out["ratio_at_top"] and level["ratio"] > 0
    assert constrained["steps"]["steps"] > 0 and free["steps"]["steps"] > 0
    assert free["structured_share_of_step"] in (0.0, None)
    assert level["engine_compiles"]["compiles"] + level["engine_compiles"]["cache_hits"] == 4
    assert set(out["compile"]["schemas"]) == {c.name for c in SCHEMAS} | {"probe"}
    for figures in out["compile"]["schemas"].values():
        assert figures["cold_ms"] > 0 and figures["cached_ms"] >= 0
    probe = out["compile_probe"]
    assert probe["typical"]["probes"] == 2 and probe["heavy"]["probes"] == 1
    assert "while_compiling_over_other_max" in probe["typical"] and probe["other_steps"] >= 0


def test_the_schema_set_and_its_examples_agree_and_failures_are_named() -> None:
    for case in SCHEMAS:
        jsonschema.validate(case.example, case.schema)
        assert check_output(json.dumps(case.example), "stop", None, case.schema) is None
    person = SCHEMAS[0].schema
    assert check_output('{"name":"A","age":3', "length", None, person).startswith(
        "not JSON (cut at max_tokens)")
    assert check_output('{"name":"A","age":300,"email":"a@b.com"}', "stop", None,
                        person).startswith("schema: age:")
    assert check_output("", "error", "boom", person) == "error: boom"
    assert typical_schema(3) != typical_schema(9) and "note_9" in typical_schema(9)
    heavy = json.loads(heavy_schema(7, fields=3))
    assert len(heavy["properties"]) == 6 and all("7_" in k for k in heavy["properties"])
