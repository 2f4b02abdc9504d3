"""`vconsole generate`: JSONL in, JSONL out in input order; a bad line costs only itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Each test runs `vconsole generate` as a process, loading the tiny model.
pytestmark = pytest.mark.proc


def test_generate_writes_one_line_per_input_in_order_with_errors_in_place(tmp_path):
    lines = [
        json.dumps({"prompt": "hello world", "max_tokens": 5}),
        "{not json",
        json.dumps({"prompt_token_ids": [10, 11, 12, 13], "max_tokens": 3, "priority": 2}),
        json.dumps({"prompt": "x", "max_tokens": 0}),
        json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0.8,
                    "top_p": 0.9, "top_k": 20, "seed": 3, "ignore_eos": True}),
        json.dumps({"prompt": "abc", "colour": "red"}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    env = {**os.environ, "VCONSOLE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "vconsole.cli", "generate", "--model", "tiny",
                           "--input", str(src), "--output", str(dst)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 1, "a bad line makes the run fail, after every good one ran"
    out = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [o["index"] for o in out] == list(range(len(lines)))
    assert [o["finish_reason"] == "error" for o in out] == [False, True, False, True, False, True]
    assert "invalid JSON" in out[1]["error"]
    assert "max_tokens" in out[3]["error"]
    assert "colour" in out[5]["error"]
    assert out[0]["num_prompt_tokens"] == len("hello world")  # byte-level tokenizer
    assert len(out[2]["output_token_ids"]) <= 3 and out[2]["num_prompt_tokens"] == 4
    assert len(out[4]["output_token_ids"]) == 4
    for o in (out[0], out[2], out[4]):
        assert set(o) >= {"index", "output_token_ids", "text", "finish_reason",
                          "num_prompt_tokens", "num_cached_tokens"}
        assert isinstance(o["text"], str)
    summary = proc.stderr.strip().splitlines()[-1]
    for key in ("requests=6", "errors=3", "tok/s=", "preemptions=", "prefix_hit_rate="):
        assert key in summary
    named = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{src}:")]
    assert [ln.split(":")[1] for ln in named] == ["2", "4", "6"], "1-based line numbers"
    assert "invalid JSON" in named[0] and "colour" in named[2]


def test_generate_with_a_bad_model_path_exits_1_with_the_reason_and_no_traceback(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    dst = tmp_path / "out.jsonl"
    missing = tmp_path / "no-such-model"
    env = {**os.environ, "VCONSOLE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "vconsole.cli", "generate", "--model",
                           str(missing), "--input", str(src), "--output", str(dst)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "vconsole generate: cannot start:" in proc.stderr
    assert str(missing) in proc.stderr and "does not exist" in proc.stderr
    assert not dst.exists()
