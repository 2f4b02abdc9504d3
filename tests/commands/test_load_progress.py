"""`vconsole load`'s progress line is drawn only where it belongs: on a terminal, by a load in
the terminal's foreground. The README's first session starts the load with ``&`` and then
`vconsole attach`: a background job writing ``\\r sent ...`` to the terminal would land on
the console's screen.

The session runs in a real pseudo-terminal (`script`), in a shell with job control (as a
person's interactive shell has it: ``set -m``), beside a foreground program that draws a top
line and waits for the load to end, as the console would.
"""

from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vconsole.commands.load import Progress, in_terminal_foreground

PROGRESS_MARK = "in-flight"

# The stand-in for `vconsole attach`: clears the screen, draws its top line, and stays in the
# foreground until the background load has written its summary.
FOREGROUND = """
import pathlib, sys, time
sys.stdout.write("\\x1b[H\\x1b[2JCONSOLE TOP LINE\\n")
sys.stdout.flush()
deadline = time.monotonic() + 240
summary = pathlib.Path("bg.txt")
while time.monotonic() < deadline:
    if summary.exists() and "errors" in summary.read_text():
        break
    time.sleep(0.1)
print("FOREGROUND DONE")
"""


def _load(engine: Any, num: int) -> str:
    eps = engine.endpoints
    return shlex.join([sys.executable, "-m", "vconsole", "load", "--input", eps["input"],
                       "--output", eps["output"], "--num", str(num), "--concurrency", "4",
                       "--prompt-len", "4:8", "--output-len", "150:200"])


@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("script"), reason="needs util-linux script for a pty")
def test_a_backgrounded_load_draws_nothing_over_the_foreground_program(
        shared_engine: Any, tmp_path: Path) -> None:
    (tmp_path / "fg.py").write_text(FOREGROUND)
    session = "\n".join([
        "set -m",                                          # job control, as interactively
        # the README's backgrounded load; its exit status kept in a file, as a job that ends
        # before `wait` is reaped and reported by the shell ("wait: %1: no such job")
        f"({_load(shared_engine, 24)} > bg.txt; echo $? > bg.rc) &",
        f"{shlex.quote(sys.executable)} fg.py",            # the console's stand-in
        "until [ -s bg.rc ]; do sleep 0.1; done; echo \"BACKGROUND EXIT $(cat bg.rc)\"",
        f"{_load(shared_engine, 8)} > fg.txt",              # the same load in the foreground
        "echo \"FOREGROUND EXIT $?\"",
    ])
    done = subprocess.run(["script", "-qfec", f"bash --norc --noprofile -c {shlex.quote(session)}",
                           "/dev/null"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=280,
                          env={**os.environ, "TERM": "xterm", "HF_HUB_OFFLINE": "1"})
    screen = done.stdout.decode(errors="replace")
    said = f"terminal:\n{screen[-3000:]}\nbg.txt:\n{(tmp_path / 'bg.txt').read_text()}"
    assert "BACKGROUND EXIT 0" in screen and "FOREGROUND EXIT 0" in screen, said
    top, _, rest = screen.partition("FOREGROUND DONE")
    assert "CONSOLE TOP LINE" in top, said
    # While the console's stand-in held the terminal, the background load wrote nothing on it.
    assert PROGRESS_MARK not in top, said
    assert "requests     24 (24 completed)" in (tmp_path / "bg.txt").read_text()
    # Control: in the foreground, the same command does draw its progress on the terminal.
    assert PROGRESS_MARK in rest.partition("BACKGROUND EXIT 0")[2], said


def test_progress_stays_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    assert not in_terminal_foreground(stream)
    progress = Progress(10, stream)
    progress.show({"sent": 1, "done": 0, "in_flight": 1, "tok_per_s": 5.0, "elapsed_s": 0.2})
    progress.end()
    assert stream.getvalue() == "" and not progress.drawn
