"""The engine's SIGUSR2 stack dump is safe to leave installed and its files safe to read: a storm
of signals never throws into the busy loop, the dump folder is used only when it is this user's
own (a planted one is refused), the sweep of dead engines' folders removes only dump folders,
hang files are pruned and read only as regular files in the hang folder, and a pid is read only
when it is the engine's (its machine and start, from ``health``). Real processes and files;
every folder is the test's own (``$VCONSOLE_STACKS_DIR``), never the shared one in /tmp."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from support.remote_engine import remote_engine_beats
from vconsole.console.screens.alerts import busy_loop_frames
from vconsole.engine.launch import stack_dump
from vconsole.engine.publish.bodies import health_body
from vconsole.shared import procs, stacks


@pytest.fixture
def private_root(tmp_path, monkeypatch):
    root = tmp_path / "stacks-root"
    monkeypatch.setenv(stacks.DIR_ENV, str(root))
    return root


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


LOOP = textwrap.dedent('''
    import sys
    from vconsole.engine.launch import stack_dump

    dumper = stack_dump.install()
    assert dumper is not None

    def python_work_in_the_loop():
        n = 0
        while not sys.stdin.closed:
            n += sum(i * i for i in range(200))
            if n < 0:
                break
        return n

    import threading
    threading.Thread(target=lambda: (sys.stdin.read(), sys.stdin.close()), daemon=True).start()
    print("ready", flush=True)
    python_work_in_the_loop()
    print("survived", dumper.seq, flush=True)
''')


def test_a_signal_storm_never_throws_into_the_loop_and_a_dump_still_works(private_root):
    proc = subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sent = 0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:               # as fast as one core sends them
            os.kill(proc.pid, stacks.SIGNAL)
            sent += 1
            if sent % 3 == 0:
                time.sleep(0.0003)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        report = stacks.capture(proc.pid, method="signal")
        assert report.method == stacks.PYTHON_DUMP
        busy = report.threads[0]
        assert busy.busy_loop and busy.name == "MainThread"
        assert any(f.function == "python_work_in_the_loop" for f in busy.frames), busy.frames
        assert not any("_on_signal" in f.function or f.function.endswith("StackDumper._dump")
                       for f in busy.frames)
        out, err = proc.communicate("", timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.startswith("survived") and "Traceback" not in err, err
    assert sent > 500


def test_a_planted_or_shared_folder_is_refused(tmp_path, private_root):
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir(mode=0o700)
    private_root.symlink_to(elsewhere)
    with pytest.raises(stack_dump.UntrustedFolder, match="symbolic link"):
        stack_dump.StackDumper(private_root / "123")
    assert list(elsewhere.iterdir()) == [], "nothing written through the link"
    private_root.unlink()
    private_root.mkdir()
    os.chmod(private_root, 0o777)
    with pytest.raises(stack_dump.UntrustedFolder, match="writable by others"):
        stack_dump.StackDumper(private_root / "123")
    assert stacks.untrusted(private_root) and not (private_root / "123").exists()
    os.chmod(private_root, 0o700)
    assert stacks.untrusted(private_root) is None
    (private_root / "f").write_text("")
    assert "not a directory" in (stacks.untrusted(private_root / "f") or "")
    # A reader does not trust dump files in such a folder either (it would signal a pid).
    os.chmod(private_root, 0o777)
    (private_root / str(os.getpid())).mkdir()
    with pytest.raises(stacks.StacksError, match="not trusting"):
        stacks.signal_dump(os.getpid())


def test_install_in_a_planted_folder_falls_back_to_no_dump(tmp_path, private_root):
    private_root.mkdir(mode=0o700)
    os.chmod(private_root, 0o770)
    code = ("from vconsole.engine.launch import stack_dump; "
            "print(stack_dump.install() is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "True"
    assert "no SIGUSR2 stack dumps" in out.stderr and "writable by others" in out.stderr


def test_the_sweep_removes_only_dead_engines_dump_folders(tmp_path, private_root):
    private_root.mkdir(mode=0o700)
    ours, foreign, linked = dead_pid(), dead_pid(), dead_pid()
    (private_root / str(ours)).mkdir()
    for name in (stacks.FAULT_FILE, stacks.JSON_FILE, stacks.NAMES_FILE):
        (private_root / str(ours) / name).write_text("x")
    (private_root / str(foreign)).mkdir()
    (private_root / str(foreign) / "important.txt").write_text("keep me")
    target = tmp_path / "target"
    target.mkdir()
    (target / stacks.FAULT_FILE).write_text("keep me too")
    (private_root / str(linked)).symlink_to(target)
    alive = private_root / str(os.getpid())
    alive.mkdir()
    stack_dump._sweep_dead()
    assert not (private_root / str(ours)).exists()
    assert (private_root / str(foreign) / "important.txt").read_text() == "keep me"
    assert (private_root / str(linked)).is_symlink()
    assert (target / stacks.FAULT_FILE).read_text() == "keep me too"
    assert alive.exists(), "a live pid's folder stays"


def test_only_the_newest_hang_files_are_kept(tmp_path):
    folder = tmp_path / "stacks"
    folder.mkdir()
    now = time.time()
    for i in range(stacks.HANG_KEEP + 5):
        p = folder / f"hang-e-{i}.txt"
        p.write_text(str(i))
        os.utime(p, (now - 1000 + i, now - 1000 + i))
    (folder / "notes.md").write_text("not a hang file")
    stacks.prune_hang_files(folder)
    kept = sorted(int(p.stem.split("-")[-1]) for p in folder.glob("hang-*.txt"))
    assert kept == list(range(5, stacks.HANG_KEEP + 5))
    assert (folder / "notes.md").exists()


def test_a_hang_file_is_read_only_as_a_regular_file_in_the_hang_folder(tmp_path):
    folder = tmp_path / "stacks"
    folder.mkdir()
    report = stacks.StackReport(7, stacks.PY_SPY, stacks.ordered([stacks.ThreadStack(
        "MainThread", 1, (stacks.Frame("hang_here", "/x/vconsole/engine/core.py", 12),))]))
    good = folder / "hang-e-7.txt"
    good.write_text(report.render())
    assert busy_loop_frames(str(good), folder=folder) == [
        "hang_here (vconsole/engine/core.py:12)"]
    fifo = folder / "hang-fifo.txt"
    os.mkfifo(fifo)
    done: list[object] = []
    reader = threading.Thread(target=lambda: done.append(busy_loop_frames(str(fifo),
                                                                          folder=folder)),
                              daemon=True)
    reader.start()
    reader.join(5)
    assert done == [[]], "a FIFO is never opened (it would block the console)"
    outside = tmp_path / "outside.txt"
    outside.write_text(report.render())
    assert busy_loop_frames(str(outside), folder=folder) == []
    (folder / "hang-link.txt").symlink_to(outside)
    assert busy_loop_frames(str(folder / "hang-link.txt"), folder=folder) == []
    assert stacks.read_hang_file("/dev/zero", folder) is None
    big = folder / "hang-big.txt"
    big.write_bytes(b"x" * (stacks.HANG_READ_MAX + 100))
    assert len(stacks.read_hang_file(big, folder) or "") == stacks.HANG_READ_MAX


def test_a_pid_is_read_only_when_it_is_the_engines_on_this_machine():
    health = health_body("idle", uptime_s=1.0, steps=0, interval_s=1.0, started_ts=0.0)
    assert health["host"] == procs.host_identity() and procs.same_host(health["host"])
    assert health["pid_start"] == procs.process_start(os.getpid()) is not None
    stacks.check_identity(os.getpid(), health["host"], health["pid_start"])   # no error
    remote = {"name": "gpu-node-7", "boot_id": "0000"}
    for method in ("py-spy", "signal"):
        with pytest.raises(stacks.StacksError,
                           match="the engine runs on gpu-node-7, not here .*: run vconsole "
                                 "stacks there"):
            stacks.capture(os.getpid(), method=method, host=remote)
    same_name = {**procs.host_identity(), "boot_id": "another-boot"}
    if procs.host_identity()["boot_id"]:
        with pytest.raises(stacks.StacksError, match="another machine"):
            stacks.check_identity(os.getpid(), same_name)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        start = procs.process_start(sleeper.pid)
        assert start is not None
        for method in ("py-spy", "signal"):
            with pytest.raises(stacks.StacksError, match="pid was reused"):
                stacks.capture(sleeper.pid, method=method, host=health["host"],
                               start=start + 1)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_pid_alive():
    assert procs.pid_alive(os.getpid()) and procs.pid_alive(1)
    assert not procs.pid_alive(dead_pid()) and not procs.pid_alive(2**40)


def test_vconsole_stacks_refuses_a_remote_engines_pid(tmp_path, capsys):
    """The health of an engine on another machine names a pid that exists here (this test's
    own): `vconsole stacks` says where to run it instead of dumping this process."""
    from vconsole import cli

    endpoint = f"ipc://{tmp_path}/telemetry"
    with remote_engine_beats(endpoint):
        code = cli.main(["stacks", "--telemetry", endpoint, "--timeout", "10",
                         "--method", "signal"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the engine runs on gpu-node-7, not here" in err and "run vconsole stacks there" in err
