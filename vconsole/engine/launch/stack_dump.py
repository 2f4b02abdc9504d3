"""StackDumper: the engine process's answer to SIGUSR2 (and SIGUSR1) — its own stacks, for whoever asks.

Installed first thing in every engine process (`install`, before the model loads), so the
supervisor's hang watchdog and `vconsole stacks` can read the stacks where py-spy may not attach
(`vconsole.shared.stacks` reads them; the file formats are described there):

- SIGUSR2 (`SIGNAL`): a Python handler (it runs in the main thread at the next bytecode)
  writes ``stacks.json``: thread names and qualified function names, and empties
  ``faulthandler.txt`` (an earlier fallback dump is not needed any more) so the file never
  grows with repeated dumps;
- SIGUSR1 (`FAULT_SIGNAL`, sent by a reader only when the Python dump did not come):
  ``faulthandler.register(SIGUSR1, all_threads=True)`` writes every thread's frames from the C
  signal handler into ``faulthandler.txt``: it needs no GIL and no Python code, so a busy loop
  stuck in native code still answers. Not chained to the Python handler on one signal: a
  chained faulthandler handler runs nested in itself (SA_NODEFER) and a burst of signals
  overflowed its stack (SIGSEGV); unchained, the kernel holds a second SIGUSR1 until the dump
  is done;
- ``threads.json``: the thread names by id, for the faulthandler text (refreshed at each dump
  and by `refresh_names`).

Cost: nothing until a signal comes; a dump holds the busy loop for about a millisecond.
The handler never raises into the code it interrupted (a failed dump is counted in ``errors``)
and a signal arriving during a dump makes it dump again once done; it takes no lock (thread names are copied from
``threading``'s registries, not through ``threading.enumerate``).
Invariant: the folder exists only while the handler is installed (removed at exit), since its
existence is what lets a reader send the signal at all. The root (``$TMPDIR/vconsole-stacks-UID``,
or ``$VCONSOLE_STACKS_DIR``) and the folder are created 0700 and used only when they are real
directories of this user that no one else may write (no dump otherwise); the sweep of dead
engines' folders removes only folders holding nothing but the dump's files.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import IO, Any

from vconsole.shared.procs import pid_alive, process_start
from vconsole.shared.stacks import (
    FAULT_FILE,
    FAULT_SIGNAL,
    JSON_FILE,
    NAMES_FILE,
    SIGNAL,
    live_dir,
    live_root,
    untrusted,
)

log = logging.getLogger(__name__)
MAX_ROUNDS = 4      # dumps one handler call makes for signals that came during its own
OUR_FILES = frozenset({FAULT_FILE, JSON_FILE, NAMES_FILE} | {f + ".tmp" for f in (JSON_FILE,
                                                                                 NAMES_FILE)})

_installed: StackDumper | None = None


class StackDumper:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seq = 0
        self.main = threading.main_thread().ident
        self.pid = os.getpid()
        self.start = process_start(os.getpid())     # a reader tells a reused pid by it
        self._busy = False
        self._pending = False                       # a signal came during a dump
        self.errors = 0                             # dumps that failed (never raised)
        root = folder.parent
        with contextlib.suppress(FileExistsError):
            root.mkdir(parents=True, mode=0o700)
        if why := untrusted(root):
            raise UntrustedFolder(why)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        if why := untrusted(folder):
            raise UntrustedFolder(why)
        self._fault: IO[bytes] = open(folder / FAULT_FILE, "ab")  # noqa: SIM115 - until close
        self.refresh_names()
        signal.signal(SIGNAL, self._on_signal)
        faulthandler.register(FAULT_SIGNAL, file=self._fault, all_threads=True, chain=False)

    def refresh_names(self) -> None:
        """Write the thread names by id (for the C-level dump, which knows ids only)."""
        _write_atomic(self.folder / NAMES_FILE, {"main": self.main, "start": self.start,
                                                 "names": {str(k): v for k, v in
                                                           _thread_names().items()}})

    def _on_signal(self, _signum: int, interrupted: FrameType | None) -> None:
        """Never raises, never runs twice at once: it interrupts the busy loop anywhere (a
        signal storm nests it in itself), so a failed dump is counted, not thrown. A signal
        arriving during a dump is not lost: it marks the dump pending and the running one
        dumps again when done (at most `MAX_ROUNDS` times per call, so a storm cannot hold the
        loop; a later signal calls the handler anew)."""
        if self._busy:
            self._pending = True
            return
        self._busy = True
        try:
            for _ in range(MAX_ROUNDS):
                self._pending = False
                try:
                    self._dump(interrupted)
                except Exception:   # noqa: BLE001 - RecursionError, a reentrant file call, ...
                    self.errors += 1    # (KeyboardInterrupt / SystemExit pass)
                if not self._pending:
                    break
        finally:
            self._busy = False

    def _dump(self, interrupted: FrameType | None) -> None:
        self.seq += 1
        names = _thread_names()
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
        _write_atomic(self.folder / NAMES_FILE, {"main": self.main, "start": self.start,
                                                 "names": {str(k): v for k, v in names.items()}})

    def close(self) -> None:
        if os.getpid() != self.pid:     # a forked child exiting: the folder is the parent's
            return
        with contextlib.suppress(Exception):
            faulthandler.unregister(FAULT_SIGNAL)
            signal.signal(FAULT_SIGNAL, signal.SIG_IGN)
            signal.signal(SIGNAL, signal.SIG_IGN)
        self._fault.close()
        _remove_ours(self.folder)


def install() -> StackDumper | None:
    """Install the handler for this process (once; main thread only). None where it cannot
    be (not the main thread, an unwritable temp folder, a folder someone else could have
    planted: `vconsole.shared.stacks.untrusted`): stacks then need py-spy."""
    global _installed
    if _installed is not None:
        return _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    _sweep_dead()
    try:
        _installed = StackDumper(live_dir(os.getpid()))
    except UntrustedFolder as e:
        log.warning("no SIGUSR2 stack dumps (stacks then need py-spy): %s", e)
        return None
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
    _remove_ours(live_dir(pid))


def _sweep_dead() -> None:
    """Remove the folders of engines that died without cleaning up (SIGKILL with no
    supervisor left to do it): a stale folder could otherwise outlive its pid. Only in a
    trusted root, and only folders that are ours (`_remove_ours`)."""
    root = live_root()
    if untrusted(root) is not None:
        return
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for folder in entries:
        if folder.name.isdigit() and not pid_alive(int(folder.name)):
            _remove_ours(folder)


def _remove_ours(folder: Path) -> None:
    """Remove a dump folder if it is one: a real directory of this user's holding nothing but
    the dump's own files (never follows a link, never removes anything else)."""
    if untrusted(folder.parent) is not None or untrusted(folder) is not None:
        return
    try:
        names = os.listdir(folder)
    except OSError:
        return
    if not set(names) <= OUR_FILES:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(folder / name)        # unlink never follows a link
    with contextlib.suppress(OSError):
        folder.rmdir()


def _thread_names() -> dict[int, str]:
    """Thread names by id without `threading.enumerate`, which takes a lock the interrupted
    main thread may hold (a signal handler taking it again would deadlock): copies of the
    module's registries, read without the lock."""
    out: dict[int, str] = {}
    for registry in (getattr(threading, "_limbo", {}), getattr(threading, "_active", {})):
        for _ in range(3):          # a dict changed by another thread while copied: again
            try:
                items = list(registry.items())
                break
            except RuntimeError:
                items = []
        for key, t in items:
            ident = getattr(t, "ident", None)
            if isinstance(ident, int):
                out[ident] = str(getattr(t, "name", key))
    return out


class UntrustedFolder(OSError):
    """The dump folder may have been planted by someone else: not used."""


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
