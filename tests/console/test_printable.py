"""Issue 27 item 11: text from elsewhere (generated text, client-chosen request ids, engine
names, error reasons) reaches the terminal with its control characters escaped — in the console
and in every CLI printer (`vconsole top`'s lines, `vconsole generate`'s output and messages)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support.console_testing import big_sched, frames, replay_app, until
from vconsole.console import format as fmt
from vconsole.telemetry.printable import printable
from vconsole.tools.top import format_line

RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")   # any but \t and \n
ESC_CLEAR = "\x1b[2J\x1b]0;owned\x07"                      # clear screen, set window title


def test_printable_writes_control_characters_as_visible_escapes():
    assert printable("plain text, ü, 漢字") == "plain text, ü, 漢字"      # untouched
    assert printable(f"a{ESC_CLEAR}b") == "a\\x1b[2J\\x1b]0;owned\\x07b"
    assert printable("nul\x00 ff\x0c del\x7f csi\x9b rlo\u202e") == \
        "nul\\x00 ff\\x0c del\\x7f csi\\x9b rlo\\u202e"
    assert printable("line\nnext\tcol\r") == "line\\nnext\\tcol\\r"
    assert printable("line\nnext\tcol\r", keep_newlines=True) == "line\nnext\tcol\\r"


def test_the_consoles_markup_and_cells_escape_them():
    assert fmt.escape(f"[b]{ESC_CLEAR}") == "\\[b]\\x1b\\[2J\\x1b]0;owned\\x07"
    assert fmt.escape("two\nlines") == "two\nlines"
    assert fmt.clip(f"id{ESC_CLEAR}\n", 40) == "id\\x1b[2J\\x1b]0;owned\\x07\\n"


@pytest.mark.slow
async def test_a_request_id_with_an_escape_sequence_is_shown_escaped():
    body = big_sched(3)
    body["requests"][0]["id"] = f"evil{ESC_CLEAR}"
    t0 = 1_700_000_000.0
    app = replay_app(records=[(t0, frames("sched", body, ts=t0))])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        table = app.screen.table
        await until(pilot, lambda: len(table.rows) == 3)
        lines = ["".join(seg.text for seg in table.render_line(y))
                 for y in range(len(table.rows))]
        assert any("evil\\x1b[2J" in ln for ln in lines)
        assert not any(RAW_CONTROL.search(ln) for ln in lines)


def test_top_lines_escape_what_came_over_the_wire():
    line = format_line({"health": {"engine": f"eng{ESC_CLEAR}", "rank": 0, "state": "running",
                                   "steps": 3, "alerts_active": {"x\x1b": "warning"}}})
    assert "eng\\x1b[2J" in line and "x\\x1b:warning" in line
    assert not RAW_CONTROL.search(line)


@pytest.mark.proc
def test_generate_writes_what_the_random_model_makes_and_its_errors_escaped(tmp_path):
    """The tiny model's random weights emit any byte; the JSONL keeps them as \\u escapes and
    stderr escapes a reason that quotes one."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "seed": 1,
                    "temperature": 1.0}),
        json.dumps({"prompt": "x", f"col{ESC_CLEAR}our": 1}),
    ]) + "\n")
    dst = tmp_path / "out.jsonl"
    env = {**os.environ, "VCONSOLE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "vconsole.cli", "generate", "--model", "tiny",
                           "--input", str(src), "--output", str(dst), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 1, proc.stderr
    raw = dst.read_text()
    assert not RAW_CONTROL.search(raw) and "\t" not in raw
    text = json.loads(raw.splitlines()[0])["text"]
    assert RAW_CONTROL.search(text), "the random model made no control character this time"
    assert "col\\x1b[2J" in proc.stderr
    assert not RAW_CONTROL.search(proc.stderr)


def test_clip_middle_keeps_the_end_that_tells_two_names_apart():
    a, b = (fmt.clip_middle(f"127.0.0.1:38421 engine {n}", 16) for n in (0, 1))
    assert a != b and len(a) == len(b) == 16
    assert a.startswith("127.0.0.") and a.endswith("ngine 0") and "…" in a
    assert fmt.clip_middle("short", 16) == "short"
    assert fmt.clip_middle(f"x{ESC_CLEAR}", 40) == fmt.clip(f"x{ESC_CLEAR}", 40)
