"""StackDumper: the engine process's answer to SIGUSR2 — its own stacks, for whoever asks.

Installed first thing in every engine process (`install`, before the model loads), so the
supervisor's hang watchdog and `vconsole stacks` can read the stacks where py-spy may not attach
(`vconsole.shared.stacks` reads them; the file formats are described there):

- ``faulthandler.register(SIGUSR2, all_threads=True, chain=True)`` writes every thread's frames
  from the C signal handler into ``faulthandler.txt``: it needs no GIL and no Python code, so a
  busy loop stuck in native code still answers;
- chained after it, a Python handler (it runs in the main thread at the next bytecode) writes
  ``stacks.json``: thread names and qualified function names, and empties ``faulthandler.txt``
  (its dump was not needed) so the file never grows with repeated dumps;
- ``threads.json``: the thread names by id, for the faulthandler text (refreshed at each dump
  and by `refresh_names`).

Cost: nothing until a signal comes; a dump holds the busy loop for about a millisecond.
Invariant: the folder exists only while the handler is installed (removed at exit), since its
existence is what lets a reader send the signal at all.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import IO, Any

from vconsole.shared.stacks import (
    FAULT_FILE,
    JSON_FILE,
    NAMES_FILE,
    SIGNAL,
    live_dir,
    live_root,
    process_start,
)

_installed: StackDumper | None = None


class StackDumper:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seq = 0
        self.main = threading.main_thread().ident
        self.pid = os.getpid()
        self.start = process_start(os.getpid())     # a reader tells a reused pid by it
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder.parent, 0o700)
        self._fault: IO[bytes] = open(folder / FAULT_FILE, "ab")  # noqa: SIM115 - until close
        self.refresh_names()
        signal.signal(SIGNAL, self._on_signal)     # first: faulthandler chains to it
        faulthandler.register(SIGNAL, file=self._fault, all_threads=True, chain=True)

    def refresh_names(self) -> None:
        """Write the thread names by id (for the C-level dump, which knows ids only)."""
        names = {str(t.ident): t.name for t in threading.enumerate() if t.ident is not None}
        _write_atomic(self.folder / NAMES_FILE, {"main": self.main, "start": self.start,
                                                 "names": names})

    def _on_signal(self, _signum: int, interrupted: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            self.seq += 1
            names = {t.ident: t.name for t in threading.enumerate()}
            here = threading.get_ident()
            threads = []
            for ident, frame in sys._current_frames().items():
                frames = []
                # This thread: from the frame the signal interrupted, not this handler's.
                f: FrameType | None = interrupted if ident == here else frame
                while f is not None:
                    frames.append({"function": f.f_code.co_qualname,
                                   "file": f.f_code.co_filename, "line": f.f_lineno or 0})
                    f = f.f_back
                threads.append({"name": names.get(ident, f"thread {ident:#x}"),
                                "ident": ident, "frames": frames})
            _write_atomic(self.folder / JSON_FILE,
                          {"seq": self.seq, "main": self.main, "threads": threads})
            self._fault.truncate(0)
            self.refresh_names()

    def close(self) -> None:
        if os.getpid() != self.pid:     # a forked child exiting: the folder is the parent's
            return
        with contextlib.suppress(Exception):
            faulthandler.unregister(SIGNAL)
            signal.signal(SIGNAL, signal.SIG_IGN)
        self._fault.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def install() -> StackDumper | None:
    """Install the handler for this process (once; main thread only). None where it cannot
    be (not the main thread, an unwritable temp folder): stacks then need py-spy."""
    global _installed
    if _installed is not None:
        return _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    _sweep_dead()
    try:
        _installed = StackDumper(live_dir(os.getpid()))
    except OSError:
        return None
    atexit.register(_installed.close)
    return _installed


def refresh_names() -> None:
    """Record the names of the threads started since `install` (the engine calls it once its
    I/O threads run)."""
    if _installed is not None:
        with contextlib.suppress(OSError):
            _installed.refresh_names()


def remove_dead(pid: int) -> None:
    """A killed engine (SIGKILL) could not clean up: its supervisor removes the folder."""
    shutil.rmtree(live_dir(pid), ignore_errors=True)


def _sweep_dead() -> None:
    """Remove the folders of engines that died without cleaning up (SIGKILL with no
    supervisor left to do it): a stale folder could otherwise outlive its pid."""
    try:
        entries = list(live_root().iterdir())
    except OSError:
        return
    for folder in entries:
        if not folder.name.isdigit():
            continue
        try:
            os.kill(int(folder.name), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
