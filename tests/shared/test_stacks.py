"""`vconsole stacks`: a live engine's threads and their stacks, the busy loop's first, by py-spy
where it may read the engine and by the engine's own SIGUSR2 dump where it may not; each report
says which, and why when py-spy was refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from vconsole import cli
from vconsole.engine.launch import stack_dump
from vconsole.shared import stacks


def run_stacks(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["stacks", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.proc
@pytest.mark.parametrize("method", ["auto", "signal"])
def test_stacks_of_a_live_engine_put_its_busy_loop_first(shared_engine, capsys, method):
    code, out, err = run_stacks(capsys, "--telemetry", shared_engine.endpoints["telemetry"],
                                "--method", method, "--json")
    assert code == 0, err
    report = json.loads(out)
    child = shared_engine.ready["child_pid"] if "child_pid" in shared_engine.ready \
        else shared_engine.ready["pid"]
    assert report["pid"] == child          # the engine process, from its health telemetry
    busy = report["threads"][0]
    assert busy["busy_loop"] and busy["name"] == "MainThread"
    functions = [f["function"] for f in busy["frames"]]
    assert any(f.endswith("run_busy_loop") for f in functions), functions
    assert not any("_on_signal" in f for f in functions), "the dump shows the loop, not itself"
    names = {t["name"] for t in report["threads"]}
    assert {"engine-input", "engine-output", "engine-control"} <= names
    if method == "signal":
        assert report["method"] == stacks.PYTHON_DUMP


@pytest.mark.proc
def test_where_py_spy_is_refused_the_engine_dumps_itself_and_the_report_says_why(
        shared_engine, capsys, monkeypatch):
    monkeypatch.setattr(stacks, "pyspy_binary", lambda: "/bin/false")   # py-spy fails
    code, out, err = run_stacks(capsys, "--telemetry", shared_engine.endpoints["telemetry"])
    assert code == 0, err
    head = out.splitlines()[:2]
    assert f"by {stacks.PYTHON_DUMP}" in head[0]
    assert "py-spy cannot read pid" in head[1] and "CAP_SYS_PTRACE" in head[1]
    assert 'Thread "MainThread"' in out.split("\n\n")[1] and "[busy loop" in out
    code, _, err = run_stacks(capsys, "--telemetry", shared_engine.endpoints["telemetry"],
                              "--native")
    assert code == 1 and "CAP_SYS_PTRACE" in err        # --native needs py-spy: no fallback


TOY = textwrap.dedent('''
    import ctypes, signal, threading, time
    from vconsole.engine.launch import stack_dump

    stack_dump.install()

    def helper():
        while True:
            time.sleep(1)

    threading.Thread(target=helper, name="helper", daemon=True).start()
    # A helper thread takes both signals (the C sleep below is not interrupted by them).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2, signal.SIGUSR1})

    def hold_the_gil_in_native_code():
        print("ready", flush=True)
        ctypes.PyDLL(None).sleep(30)      # C code, GIL held: no Python handler can run

    hold_the_gil_in_native_code()
''')


@pytest.fixture
def private_root(tmp_path, monkeypatch):
    """The test's own dump root (inherited by its processes), not the one in /tmp that other
    engines on this machine share."""
    monkeypatch.setenv(stacks.DIR_ENV, str(tmp_path / "stacks-root"))


@pytest.mark.proc
def test_a_loop_stuck_in_native_code_still_answers_through_faulthandler(private_root):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stacks.live_dir(gone.pid).mkdir(parents=True, mode=0o700)   # killed without cleanup
    os.chmod(stacks.live_root(), 0o700)
    proc = subprocess.Popen([sys.executable, "-c", TOY], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        # "ready" is printed just before the C call: wait until the main thread is asleep in
        # it (a signal taken before would run the Python dump, rightly).
        toy = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30
        while toy.status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not stacks.live_dir(gone.pid).exists(), "swept by the next engine's install"
        report = stacks.capture(proc.pid, method="signal", python_wait_s=0.5)
        assert report.method == stacks.FAULTHANDLER
        assert "did not run Python" in (report.note or "")
        busy = report.threads[0]
        assert busy.busy_loop and busy.name == "MainThread"
        assert busy.top == "hold_the_gil_in_native_code"
    finally:
        proc.kill()
        proc.wait()
    assert stacks.live_dir(proc.pid).exists()   # SIGKILL: left for the supervisor to remove,
    stack_dump.remove_dead(proc.pid)            # or the next engine that starts here


def test_no_stacks_say_why(capsys):
    code, _, err = run_stacks(capsys, "--pid", "1", "--method", "signal")
    assert code == 1 and "has no stack dump handler" in err
    code, _, err = run_stacks(capsys, "--pid", "999999999")
    assert code == 1 and "no process 999999999" in err
    code, _, err = run_stacks(capsys, "--pid", "1", "--method", "signal", "--native")
    assert code == 1 and "--native needs py-spy" in err
    code, _, err = run_stacks(capsys, "--pid", "0")
    assert code == 2


def test_faulthandler_text_is_read_with_the_names_last_seen():
    text = ('Thread 0x00000000000000aa (most recent call first):\n'
            '  File "/x/threading.py", line 320 in wait\n\n'
            'Current thread 0x00000000000000bb (most recent call first):\n'
            '  File "/x/vconsole/engine/core.py", line 12 in step\n'
            '  File "/x/vconsole/engine/process/core_proc.py", line 250 in run_busy_loop\n')
    threads = stacks.ordered(stacks.parse_faulthandler(text, {0xbb: "MainThread"}))
    assert [t.name for t in threads] == ["MainThread", "thread 0x00000000000000aa"]
    assert threads[0].busy_loop and threads[0].top == "step"
    assert threads[0].frames[1] == stacks.Frame("run_busy_loop",
                                                "/x/vconsole/engine/process/core_proc.py", 250)


def test_a_reused_pid_is_never_signalled(private_root):
    """A killed engine's folder outlives it; a new process that got its pid is left alone."""
    proc = subprocess.Popen(["sleep", "30"])
    folder = stacks.live_dir(proc.pid)
    try:
        folder.mkdir(parents=True, mode=0o700)
        os.chmod(folder.parent, 0o700)
        (folder / stacks.FAULT_FILE).write_text("")
        (folder / stacks.NAMES_FILE).write_text(json.dumps({"main": 1, "start": 1, "names": {}}))
        with pytest.raises(stacks.StacksError, match="pid reused"):
            stacks.capture(proc.pid, method="signal")
        assert proc.poll() is None, "SIGUSR2 would have killed it"
    finally:
        proc.kill()
        proc.wait()
        for f in folder.glob("*"):
            f.unlink()
        folder.rmdir()


def test_py_spy_errors_are_read_as_one_line_without_the_backtrace():
    said = ("Process 1: python\n\nError: Failed to get stack traces\n\nCaused by:\n"
            "    0: Failed to suspend process\n    1: EPERM: Operation not permitted\n"
            "    2: EPERM: Operation not permitted\n\nStack backtrace:\n   0: main\n")
    assert stacks.pyspy_error(said) == ("Failed to get stack traces; Failed to suspend process; "
                                        "EPERM: Operation not permitted")
    assert stacks.pyspy_error("Error: Failed to find python version from target process\n") \
        == "Failed to find python version from target process"
