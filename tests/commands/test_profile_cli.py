"""`vconsole profile` against a real engine: the JSON and the tables, progress, exit codes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading

import pytest

from vconsole.cli import build_parser
from vconsole.commands.profile import main as main_profile
from vconsole.engine.client.client import EngineClient


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The session's shared engine (tests/conftest.py): these tests only use it."""
    return shared_engine


@contextlib.contextmanager
def load(engine):
    """Requests back to back from a client thread until the block ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
                while not stop.is_set():
                    # Short answers: a prompt step (the Python layers, whose attention and
                    # MLP ranges the profile names) every third step, so any window of 3 or
                    # more steps holds one; the two decode steps between, at most 8 rows, run
                    # as one native call (`decode_step`) without those ranges.
                    ids = [c.submit(prompt_token_ids=[3 + i, 40, 41, 42 + i], max_tokens=3)
                           for i in range(6)]
                    done = c.gather(ids, timeout_s=120)
                    assert all(d.finished and not d.error for d in done.values())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors


def vconsole(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vconsole.cli", *argv], capture_output=True,
                          text=True, timeout=300)


def test_the_parser_takes_the_flags_set_takes():
    args = build_parser().parse_args(["profile", "--steps", "5", "--json", "--timeout", "9",
                                      "--control", "ipc:///x", "--control-key-file", "k"])
    assert (args.steps, args.json, args.timeout) == (5, True, 9.0)
    assert (args.control, args.control_key_file) == ("ipc:///x", "k")
    assert build_parser().parse_args(["profile"]).steps == 20


@pytest.mark.proc
def test_steps_out_of_range_is_a_usage_error(engine):
    r = vconsole("profile", "--steps", "0", "--control", engine.endpoints["control"])
    assert r.returncode == 2 and "--steps must be from 1 to 200" in r.stderr


@pytest.mark.proc
def test_without_the_key_file_it_exits_1_and_profiles_nothing(engine, tmp_path):
    missing = tmp_path / "nope.key"
    r = vconsole("profile", "--control", engine.endpoints["control"],
                 "--control-key-file", str(missing))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot read the engine's control key {missing}" in r.stderr
    assert "profiling the next" not in engine.log_path.read_text()


@pytest.mark.proc
@pytest.mark.slow
def test_an_idle_engine_times_out_and_the_profile_is_cancelled(engine):
    r = vconsole("profile", "--steps", "5", "--timeout", "1", "--control",
                 engine.endpoints["control"])
    assert r.returncode == 1
    assert "did not finish within 1 s (0/5 steps); it was cancelled" in r.stderr
    assert "profile p1: 0/5 steps" in r.stderr
    assert "profile p1 cancelled after 0 steps" in engine.log_path.read_text()


@pytest.mark.proc
@pytest.mark.slow
def test_json_of_a_loaded_engine(engine):
    with load(engine):
        r = vconsole("profile", "--steps", "10", "--json", "--control",
                     engine.endpoints["control"])
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["steps"] == 10 and result["last_step"] - result["first_step"] == 10
    assert {"ops", "phases", "phase_s", "layers", "wall_s", "slowdown_note"} <= set(result)
    ops = result["ops"]
    assert ops and all(set(op) == {"name", "self_cpu_s", "self_cuda_s", "calls"} for op in ops)
    assert [op["self_cpu_s"] for op in ops] == sorted((op["self_cpu_s"] for op in ops),
                                                      reverse=True)
    assert sum(result["phases"].values()) == pytest.approx(1.0)
    assert {"attention", "mlp"} <= set(result["layers"])
    assert f"profile {result['id']}: " in r.stderr and "/10 steps" in r.stderr   # progress


@pytest.mark.proc
@pytest.mark.slow
def test_the_tables_of_a_loaded_engine(engine, capsys):
    args = build_parser().parse_args(["profile", "--steps", "5", "--control",
                                      engine.endpoints["control"]])
    with load(engine):
        code = main_profile(args)
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].startswith("profile p") and ": 5 steps (engine steps " in lines[0]
    assert "slower" in lines[1]
    assert "step phases" in out.out and "  execute " in out.out
    assert "time by layer type (CPU time, inclusive)" in out.out
    assert any(line.lstrip().startswith("attention ") for line in lines)
    assert "operators by self CPU time" in out.out and "aten::" in out.out
