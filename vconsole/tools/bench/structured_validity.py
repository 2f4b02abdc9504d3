"""`bench structured`'s validity: each constrained output through ``json.loads`` and
``jsonschema.validate``, and the failures counted by kind with an example of each."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from vconsole.tools.bench.structured_runs import Done, Job


def check_output(text: str, finish_reason: str | None, error: str | None,
                 schema: dict[str, Any]) -> str | None:
    """Why the output is not a valid instance of ``schema`` (None when it is)."""
    import jsonschema

    if error:
        return f"error: {error}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (cut at max_tokens)" if finish_reason == "length" else ""
        return f"not JSON{cut}: {e.msg}"
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"schema: {where}: {e.message[:120]}"
    return None


def validity(tokenizer: Any, jobs: list[Job], done: list[Done]) -> dict[str, Any]:
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for job, d in zip(jobs, done, strict=True):
        text = tokenizer.decode(d.token_ids, skip_special_tokens=True)
        why = check_output(text, d.finish_reason, d.error, job.case.schema)
        if why is not None:
            kind = why.split(":", 1)[0]
            reasons[kind] += 1
            examples.setdefault(kind, f"{job.case.name}: {why}; output {text[:160]!r}")
    n = len(done)
    return {"requests": n, "valid": n - sum(reasons.values()),
            "valid_rate": round((n - sum(reasons.values())) / n, 4) if n else None,
            "failures": dict(reasons), "failure_examples": examples}

