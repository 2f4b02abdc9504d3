"""The README's "first session by hand" runs as it stands: its shell block, verbatim, in bash,
in an empty folder, with the installed `vconsole` first on PATH.

Two things differ from a person at a terminal, and only these: ``VCONSOLE_BASE_PORT`` moves the
session off the default ports (so a running engine on this machine is left alone), and the two
full-screen commands (`vconsole attach`, `vconsole replay`) run in a pseudo-terminal (`script`)
that presses ``q`` once the screen shows what it is for, as the person would. Each must draw its screen and quit
with exit code 0; every other line must succeed too (``set -e``, ``pipefail``), and the engine
must drain and exit 0 at the `kill %1`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SCREEN_WAIT_S = 90    # the longest a full-screen command is watched before q
SESSION_TIMEOUT_S = 300

# `vconsole` as the session sees it: a full-screen command gets a pseudo-terminal, and q once
# its screen shows what it is for (the engine's figures; the replay's end) or after
# SCREEN_WAIT_S; every other command is the installed entry point itself (exec: `kill %1`
# reaches the engine).
WRAPPER = f"""#!/usr/bin/env bash
case "$1" in
    attach|replay)
        if [ "$1" = attach ]; then mark="tok/s"; else mark="END "; fi
        screen="screen-$1.out"
        (for _ in $(seq {SCREEN_WAIT_S * 10}); do
             grep -aqF "$mark" "$screen" 2>/dev/null && break; sleep 0.1
         done; sleep 1; printf q) |
            script -qefc "$(printf '%q ' "$VCONSOLE_REAL" "$@")" "$screen" > /dev/null ;;
    *) exec "$VCONSOLE_REAL" "$@" ;;
esac
"""
PRELUDE = "set -euo pipefail\n"
# After it: wait for the engine the block stopped, and say how it ended.
EPILOGUE = """
set +e
wait %1
echo "ENGINE EXIT $?"
"""


def session_block() -> str:
    """The first ```sh block under "A first session by hand"."""
    text = README.read_text()
    section = text[text.index("## A first session by hand"):]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "the README has a first session"
    return match.group(1)


def free_base_port() -> int:
    """Four consecutive free loopback ports."""
    for _ in range(50):
        base = random.randrange(20000, 40000)
        socks = []
        try:
            for i in range(4):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no four free consecutive ports")


@pytest.mark.long   # make test-long: each of its commands has its own test in make test (test_control_cli,
# test_loadgen, test_console_live, test_record and test_cli, test_generate_cli); this is the text
@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("script") and shutil.which("jq")),
                    reason="needs util-linux script and jq, as the README's reader does")
def test_the_readme_first_session_runs_as_written(tmp_path):
    block = session_block()
    assert "vconsole attach" in block and "kill %1" in block
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "vconsole"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    real = Path(sys.executable).parent / "vconsole"
    env = {**os.environ, "PATH": f"{bindir}:{real.parent}:{os.environ['PATH']}",
           "VCONSOLE_REAL": str(real),
           "VCONSOLE_BASE_PORT": str(free_base_port()), "HF_HUB_OFFLINE": "1",
           "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"}
    work = tmp_path / "session"
    work.mkdir()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    # Files, not pipes: a process the session left behind cannot hold the test up.
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(["bash", "-c", PRELUDE + block + EPILOGUE], cwd=work, env=env,
                                stdout=o, stderr=e, start_new_session=True)
        try:
            code = proc.wait(SESSION_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)     # anything the session left running
    stdout, stderr = out.read_text(), err.read_text()
    said = f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    assert code == 0, said
    assert "ENGINE EXIT 0" in stdout, said

    # `set` applied, `get` answers with the new values.
    assert "applied  max_num_seqs = 8" in stdout and "applied  policy = hybrid" in stdout, said
    assert re.search(r"^max_num_seqs\s+8\s+hot$", stdout, re.M), said
    # `top --once --json | jq .kv.usage`: the pool's use, a fraction.
    assert re.search(r"^(0(\.\d+)?(e-\d+)?|1(\.0)?)$", stdout, re.M), said
    # The load: 200 requests, none failed.
    load = (work / "load.txt").read_text()
    assert "200 (200 completed)" in load and "errors       none" in load, load
    # Both screens were drawn, and the replay reached its end.
    attach = (work / "screen-attach.out").read_text(errors="replace")
    assert "Overview" in attach and "tok/s" in attach, "the console showed the engine"
    replay = (work / "screen-replay.out").read_text(errors="replace")
    assert "END" in replay and "run.vrec" in replay
    assert (work / "run.vrec").stat().st_size > 0
    # `generate`: one answer line for the one prompt.
    lines = (work / "out.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]).get("text") is not None


def serve_block() -> str:
    """The ```sh block under "An OpenAI-compatible server"."""
    text = README.read_text()
    section = text[text.index("## An OpenAI-compatible server"):]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "the README shows the server"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.proc
@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl, as the README's reader does")
@pytest.mark.long   # make test-long: test_serve runs serve through the SDK and curl's routes
def test_the_readme_serve_block_runs_as_written(tmp_path):
    """As it stands, except port 8000 (maybe taken on this machine) for a free one."""
    block = serve_block()
    assert "vconsole serve" in block and "kill %1" in block and ":8000" in block
    port = str(free_port())
    block = block.replace("--port 8000", f"--port {port}").replace(":8000", f":{port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "VCONSOLE_BASE_PORT": str(free_base_port()), "HF_HUB_OFFLINE": "1"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(["bash", "-c", PRELUDE + block + EPILOGUE], cwd=tmp_path,
                                env=env, stdout=o, stderr=e, start_new_session=True)
        try:
            code = proc.wait(SESSION_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = out.read_text(), err.read_text()
    said = f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert code == 0, said
    body = json.loads(stdout.splitlines()[0])
    assert body["object"] == "text_completion" and body["model"] == "tiny", said
    assert body["usage"]["prompt_tokens"] == len("Hello"), said
    assert "ENGINE EXIT 0" in stdout, said                # `kill %1`: a clean stop
    assert "engine stopped (exit code 0)" in stderr, said
