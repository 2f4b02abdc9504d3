"""Live stacks: every thread of an engine process and its Python frames, read from outside.

Two ways in, tried in this order (``method="auto"``):

1. **py-spy** (`py-spy dump --pid PID --json`, the ``py-spy`` package): reads the process's
   memory, so it works however stuck the engine is, and ``--native`` adds C/C++ frames. It needs
   the OS to allow reading another process's memory (``ptrace``): Yama's ``ptrace_scope`` 0 or
   root, and ``CAP_SYS_PTRACE`` in a container. Where that is refused it fails, and:
2. **the engine's own dump** through a signal (`SIGNAL`, SIGUSR2): every engine process installs
   `vconsole.engine.launch.stack_dump` at start, before it loads its model. The signal runs, at
   the main thread's next bytecode, a Python handler that writes ``stacks.json`` (thread names,
   qualified function names). The reader takes the JSON when it comes within `PYTHON_WAIT_S`
   (signalling again every `RESIGNAL_S`: one request amid a burst of others can be folded into
   theirs); else it sends `FAULT_SIGNAL` (SIGUSR1), whose ``faulthandler`` C-level dump of every
   thread goes into ``faulthandler.txt`` (works even while the busy loop holds the GIL in native
   code, but knows thread ids only), read with the names last seen (``threads.json``). Two
   signals, not faulthandler chained to the Python handler: a chained faulthandler takes its
   signal nested in itself (SA_NODEFER), and a burst of signals then overflows its stack.

Files live in `live_dir` (``$TMPDIR/vconsole-stacks-UID/PID``, mode 0700): the directory's
existence is the engine's promise that SIGUSR2 is handled, so nothing here ever signals a pid
without it (SIGUSR2's default action would kill the process).

Every report says which method produced it and, when py-spy failed, why and what to change.
The busy loop's thread (the one running ``run_busy_loop``, else the main thread) comes first.
Standard library only: the supervisor, the CLI and the console all read stacks through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vconsole.shared.procs import host_identity, pid_alive, process_start, same_host

__all__ = ["process_start"]    # re-exported: the engine's dump records its own start

SIGNAL = signal.SIGUSR2           # the engine's Python dump
FAULT_SIGNAL = signal.SIGUSR1     # its faulthandler dump (the fallback)
PYSPY_TIMEOUT_S = 5.0     # one py-spy dump (it reads memory; never slow unless refused)
PYTHON_WAIT_S = 1.0       # the engine's Python-level answer to the signal
RESIGNAL_S = 0.3         # no answer yet: signal again (the engine answers once per burst)
FAULT_SETTLE_S = 0.2      # then the faulthandler text is complete (it is written in the handler)
METHODS = ("auto", "py-spy", "signal")
METHOD_ENV = "VCONSOLE_STACKS_METHOD"   # what "auto" means here (e.g. signal: never ptrace)
DIR_ENV = "VCONSOLE_STACKS_DIR"         # the live dumps' root instead of $TMPDIR/vconsole-stacks-UID
HANG_KEEP = 50                          # hang files kept in `hang_dir` (the newest)
PY_SPY, PYTHON_DUMP, FAULTHANDLER = "py-spy", "signal (engine's Python dump)", "signal (faulthandler)"
BUSY_LOOP_FUNCTION = "run_busy_loop"

FAULT_FILE, JSON_FILE, NAMES_FILE = "faulthandler.txt", "stacks.json", "threads.json"


class StacksError(RuntimeError):
    """No stacks: the message says why and, where the OS refused, what to change."""


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int


@dataclass(frozen=True)
class ThreadStack:
    """One thread; ``frames`` innermost first (as py-spy and faulthandler print them)."""

    name: str
    ident: int
    frames: tuple[Frame, ...]
    busy_loop: bool = False
    state: str = ""            # py-spy: "active" / "idle"; "" when unknown

    @property
    def top(self) -> str:
        """The innermost frame's function, or "" for a thread with no Python frame."""
        return self.frames[0].function if self.frames else ""


@dataclass(frozen=True)
class StackReport:
    pid: int
    method: str
    threads: tuple[ThreadStack, ...]
    taken_ts: float = field(default_factory=time.time)
    note: str | None = None    # why this method and not py-spy, or what is missing
    rank: int | None = None        # data parallel: which rank's process this is ...
    world_size: int | None = None  # ... of how many (each rank is a process of its own)

    @property
    def busy_loop(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.busy_loop), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self, *, max_frames: int | None = None) -> str:
        """The text a person reads: a header, then per thread its name and frames."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.taken_ts))
        which = (f", rank {self.rank} of {self.world_size}"
                 if self.rank is not None and (self.world_size or 1) > 1 else "")
        lines = [f"pid {self.pid}{which}: {len(self.threads)} threads, by {self.method}, "
                 f"at {when}"]
        if self.note:
            lines.append(f"note: {self.note}")
        for t in self.threads:
            tags = [s for s in ("busy loop" if t.busy_loop else "", t.state) if s]
            lines += ["", f'Thread "{t.name}" ({t.ident})' + (f" [{', '.join(tags)}]"
                                                              if tags else "")]
            frames = t.frames if max_frames is None else t.frames[:max_frames]
            lines += [f"    {f.function} ({short_path(f.file)}:{f.line})" for f in frames]
            if len(frames) < len(t.frames):
                lines.append(f"    … {len(t.frames) - len(frames)} more")
            if not t.frames:
                lines.append("    (no Python frame)")
        return "\n".join(lines)


def short_path(path: str) -> str:
    """``…/site-packages/torch/nn/x.py`` -> ``torch/nn/x.py``; the repo's own files from
    ``vconsole/``."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    i = path.rfind("/vconsole/")
    if i >= 0:
        return path[i + 1:]
    m = re.search(r"/lib/python3\.\d+/", path)
    return path[m.end():] if m else path


def ordered(threads: Sequence[ThreadStack], main_ident: int | None = None) -> tuple[
        ThreadStack, ...]:
    """Mark the busy loop's thread (the one in `BUSY_LOOP_FUNCTION`, else the main thread)
    and put it first; the rest by name."""
    busy = next((t.ident for t in threads
                 if any(f.function.endswith(BUSY_LOOP_FUNCTION) for f in t.frames)), None)
    if busy is None:
        busy = next((t.ident for t in threads
                     if t.ident == main_ident or t.name == "MainThread"), None)
    marked = [ThreadStack(t.name, t.ident, t.frames, t.ident == busy, t.state) for t in threads]
    return tuple(sorted(marked, key=lambda t: (not t.busy_loop, t.name, t.ident)))


# --- where an engine keeps its dumps -------------------------------------------------------------

def live_root() -> Path:
    """``$VCONSOLE_STACKS_DIR`` if set (a test's private folder), else
    ``$TMPDIR/vconsole-stacks-UID``."""
    own = os.environ.get(DIR_ENV)
    if own:
        return Path(own).expanduser()
    return Path(tempfile.gettempdir()) / f"vconsole-stacks-{os.getuid()}"


def untrusted(folder: Path) -> str | None:
    """Why ``folder`` may not hold dumps (None: it may): it must be a real directory (no
    symlink), owned by this user and writable by no one else. A shared temp folder lets anyone
    create the name first; such a folder is refused, never used or removed."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        return f"{folder}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{folder} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{folder} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def live_dir(pid: int) -> Path:
    """Engine ``pid``'s dump folder (see the module docstring)."""
    return live_root() / str(pid)


def hang_dir() -> Path:
    """Where a supervisor keeps the stacks of engines it killed as hung: ``$VCONSOLE_CACHE/
    stacks``, else ``~/.cache/vconsole/stacks`` (they outlive the engine and its temp files)."""
    base = os.environ.get("VCONSOLE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "vconsole") / "stacks"


HANG_READ_MAX = 1 << 20                 # bytes of a hang file a reader takes at most


def prune_hang_files(folder: Path | None = None, keep: int = HANG_KEEP) -> None:
    """Keep the newest ``keep`` hang files (``hang-*.txt``, regular files) in ``folder``
    (`hang_dir`); an engine hanging in a loop must not fill the disk."""
    folder = hang_dir() if folder is None else folder
    found: list[tuple[float, Path]] = []
    try:
        for p in folder.iterdir():
            if p.name.startswith("hang-") and p.name.endswith(".txt"):
                with contextlib.suppress(OSError):
                    st = os.lstat(p)
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime, p))
    except OSError:
        return
    found.sort(key=lambda x: (x[0], x[1].name), reverse=True)
    for _, p in found[keep:]:
        with contextlib.suppress(OSError):
            p.unlink()


def read_hang_file(path: str | Path, folder: Path | None = None) -> str | None:
    """The text of a hang file a message names, or None: only a regular file (no symlink,
    FIFO or device) directly in ``folder`` (`hang_dir`), at most `HANG_READ_MAX` bytes, opened
    non-blocking: a name in a telemetry message can never make the reader block or read
    elsewhere."""
    folder = hang_dir() if folder is None else folder
    p = Path(path)
    try:
        if os.path.realpath(p.parent) != os.path.realpath(folder):
            return None
        if not stat.S_ISREG(os.lstat(p).st_mode):
            return None
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):      # swapped since the lstat
            return None
        return os.read(fd, HANG_READ_MAX).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


# --- the ways in --------------------------------------------------------------------------------

def capture(pid: int, *, method: str = "auto", native: bool = False,
            python_wait_s: float = PYTHON_WAIT_S, host: Any = None,
            start: int | None = None) -> StackReport:
    """Every thread of process ``pid`` (see the module docstring). ``native``: C frames too,
    which needs py-spy. ``auto`` is ``$VCONSOLE_STACKS_METHOD`` when set (the supervisor's hang
    captures follow it too). ``host`` and ``start``: the engine's ``health`` fields ``host`` and
    ``pid_start``; when given, a pid of another machine, or a pid reused by another process
    here, is refused before either way reads it (`check_identity`). Raises `StacksError` with
    the reason and what to change."""
    if method == "auto":
        method = os.environ.get(METHOD_ENV, "").strip() or "auto"
    if method not in METHODS:
        raise StacksError(f"unknown stacks method {method!r} (--method, ${METHOD_ENV}): one "
                          f"of {', '.join(METHODS)}")
    check_identity(pid, host, start)
    if not pid_alive(pid):
        raise StacksError(f"no process {pid} on this machine (stacks are read locally: run "
                          "this on the engine's host)")
    if native and method == "signal":
        raise StacksError("--native needs py-spy (the signal dump has Python frames only)")
    why_not_pyspy: str | None = None
    if method in ("auto", "py-spy"):
        try:
            return pyspy_dump(pid, native=native)
        except StacksError as e:
            if method == "py-spy" or native:
                raise
            why_not_pyspy = str(e)
    report = signal_dump(pid, python_wait_s=python_wait_s)
    if why_not_pyspy:
        note = f"{why_not_pyspy}; used the engine's own dump instead"
        report = StackReport(report.pid, report.method, report.threads, report.taken_ts,
                             f"{report.note}; {note}" if report.note else note)
    return report


def check_identity(pid: int, host: Any = None, start: int | None = None) -> None:
    """Refuse (`StacksError`) unless pid ``pid`` here is the engine that reported ``host``
    (`vconsole.shared.procs.host_identity`) and ``start`` (its process start); None: not
    known (an engine older than these fields, or ``--pid``), not checked."""
    if host is not None and not same_host(host):
        name = host.get("name") if isinstance(host, dict) else None
        here = host_identity()["name"]
        where = (f"the engine runs on {name}, not here ({here})" if name and name != here
                 else f"the engine runs on another machine (or boot) than this one ({here})")
        raise StacksError(f"{where}: run vconsole stacks there (stacks are read on the "
                          f"engine's host; pid {pid} here is another process)")
    if start is not None:
        here_start = process_start(pid)
        if here_start != start:
            raise StacksError(f"pid {pid} is not the engine that reported it (that process "
                              "exited and its pid was reused, or it is gone); not reading it")


def pyspy_binary() -> str | None:
    """py-spy beside this interpreter (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def pyspy_dump(pid: int, *, native: bool = False,
               timeout_s: float = PYSPY_TIMEOUT_S) -> StackReport:
    exe = pyspy_binary()
    if exe is None:
        raise StacksError("py-spy is not installed (pip install py-spy)")
    cmd = [exe, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
    for attempt in range(2):    # a second reader attached at the same moment: try once more
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                 check=False)
        except subprocess.TimeoutExpired:
            raise StacksError(f"py-spy did not answer within {timeout_s:g} s") from None
        if out.returncode == 0 or attempt:
            break
        time.sleep(0.2)
    if out.returncode != 0:
        why = pyspy_error(out.stderr + "\n" + out.stdout) or f"exit code {out.returncode}"
        raise StacksError(f"py-spy cannot read pid {pid} ({why}): {ptrace_hint()}")
    try:
        return StackReport(pid, PY_SPY, ordered(parse_pyspy(json.loads(out.stdout), pid)))
    except (ValueError, KeyError, TypeError) as e:
        raise StacksError(f"py-spy's output is not what this version reads: {e}") from None


def parse_pyspy(data: Any, pid: int) -> list[ThreadStack]:
    """py-spy's ``--json`` threads."""
    threads = []
    for t in data:
        name = t.get("thread_name") or ("MainThread" if t.get("os_thread_id") == pid
                                        else f"thread {t.get('os_thread_id')}")
        frames = tuple(Frame(str(f.get("name")), str(f.get("filename") or ""),
                             int(f.get("line") or 0)) for f in t.get("frames") or ())
        state = "" if t.get("active") is None else ("active" if t["active"] else "idle")
        threads.append(ThreadStack(str(name), int(t.get("thread_id") or 0), frames,
                                   state=state))
    return threads


def pyspy_error(text: str) -> str:
    """py-spy's error and its causes on one line (``Error: …`` and the ``Caused by`` items,
    without its backtrace)."""
    parts: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Stack backtrace"):
            break
        if s.startswith("Error:"):
            parts.append(s[len("Error:"):].strip())
        elif parts and (m := re.match(r"^\d+: (.*)$", s)):
            parts.append(m.group(1))
    return "; ".join(dict.fromkeys(parts))


def ptrace_hint() -> str:
    """What to change so py-spy may read another process."""
    scope = None
    with contextlib.suppress(OSError, ValueError):
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    parts = []
    if scope is not None and scope > 0:
        parts.append(f"kernel.yama.ptrace_scope is {scope}: run as root or "
                     "`sudo sysctl kernel.yama.ptrace_scope=0`")
    parts.append("in a container, grant CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE; "
                 "Kubernetes securityContext.capabilities.add: [SYS_PTRACE]) and allow "
                 "process_vm_readv in its seccomp profile")
    return "; ".join(parts)


def signal_dump(pid: int, *, python_wait_s: float = PYTHON_WAIT_S) -> StackReport:
    """Ask engine ``pid`` to dump its own stacks (SIGUSR2; see the module docstring)."""
    folder = live_dir(pid)
    fault, js = folder / FAULT_FILE, folder / JSON_FILE
    if folder.exists() and (why := untrusted(live_root()) or untrusted(folder)):
        raise StacksError(f"not trusting the stack dump folder of pid {pid}: {why}")
    if not fault.exists():
        raise StacksError(f"pid {pid} has no stack dump handler ({folder} is missing): it is "
                          "not a vconsole engine process, or one started before this version")
    recorded = (_read_json(folder / NAMES_FILE) or {}).get("start")
    if recorded is not None and recorded != process_start(pid):
        raise StacksError(f"pid {pid} is not the engine that left {folder} (that one was "
                          "killed and its pid reused); not signalling it")
    seq = _json_seq(js)
    try:
        os.kill(pid, SIGNAL)
    except ProcessLookupError:
        raise StacksError(f"no process {pid}") from None
    except PermissionError:
        raise StacksError(f"not allowed to signal pid {pid} (another user's engine): run "
                          "this as that user, or as root") from None
    deadline = time.monotonic() + python_wait_s
    again = time.monotonic() + RESIGNAL_S
    while time.monotonic() < deadline:
        if time.monotonic() >= again:       # a request that came amid others' can be lost
            again += RESIGNAL_S
            with contextlib.suppress(OSError):
                os.kill(pid, SIGNAL)
        if (report := _python_report(pid, js, seq)) is not None:
            return report
        time.sleep(0.02)
    offset = _size(fault)
    with contextlib.suppress(OSError):
        os.kill(pid, FAULT_SIGNAL)
    time.sleep(FAULT_SETTLE_S)
    if (late := _python_report(pid, js, seq)) is not None:
        return late
    text = _read_from(fault, offset)
    if not text.strip():
        state = _proc_state(pid)
        why = ("it is stopped (SIGSTOP or a debugger): `kill -CONT` it" if state == "T"
               else f"process state {state or 'unknown'}")
        raise StacksError(f"pid {pid} did not answer {signal.Signals(SIGNAL).name} nor "
                          f"{signal.Signals(FAULT_SIGNAL).name} within "
                          f"{python_wait_s + FAULT_SETTLE_S:g} s: {why}")
    names = _read_json(folder / NAMES_FILE) or {}
    threads = parse_faulthandler(text, {int(k): v for k, v in names.get("names", {}).items()})
    return StackReport(pid, FAULTHANDLER, ordered(threads, names.get("main")),
                       note=f"the busy loop did not run Python within {python_wait_s:g} s "
                            "(stuck in native code holding the GIL?): faulthandler's dump, "
                            "function names without their class, thread names as last seen")


def _python_report(pid: int, js: Path, seq: int) -> StackReport | None:
    """The engine's Python dump, if one newer than ``seq`` is there."""
    data = _read_json(js)
    if data is None or data.get("seq", 0) <= seq:
        return None
    threads = [ThreadStack(str(t["name"]), int(t["ident"]),
                           tuple(Frame(f["function"], f["file"], int(f["line"]))
                                 for f in t["frames"])) for t in data["threads"]]
    return StackReport(pid, PYTHON_DUMP, ordered(threads, data.get("main")))


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str, names: dict[int, str]) -> list[ThreadStack]:
    """faulthandler's ``dump_traceback(all_threads=True)`` text; the last dump in ``text``
    wins for a thread seen twice."""
    threads: dict[int, tuple[str, list[Frame]]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        if m := _THREAD.match(line):
            ident = int(m.group(2), 16)
            current = []
            threads[ident] = (names.get(ident, f"thread {m.group(2)}"), current)
        elif current is not None and (m := _FRAME.match(line)):
            current.append(Frame(m.group(3), m.group(1), int(m.group(2))))
    return [ThreadStack(name, ident, tuple(frames)) for ident, (name, frames) in threads.items()]


# --- small helpers ------------------------------------------------------------------------------

def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) < offset:   # truncated by the engine meanwhile
                offset = 0
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _json_seq(path: Path) -> int:
    data = _read_json(path)
    return int(data.get("seq", 0)) if data else 0


def _proc_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]
