"""The console's calibrations: which one a prediction stands on, and running a new one.

The console's trace comes over the control channel and lives nowhere, so a calibration of it
is kept in `vconsole.whatif.calibration.calibrations_dir` (``$VCONSOLE_CACHE/calibrations``):
the trace as ``MODEL-FINGERPRINT-STAMP.jsonl`` and its calibration beside it, as
``vconsole whatif TRACE --calibrate`` leaves one beside any trace. A prediction uses the
newest calibration of an engine like the one watched (`pick`: the same model and the keys that
set a step's cost, `vconsole.whatif.calibration.fingerprint`), and says which, or
`NO_CALIBRATION`.

`Calibrator.run` *is* ``vconsole whatif TRACE --calibrate``, as a child process: that command
starts an engine of its own with the trace's model and config, probes it and stops it. The
console never imports the engine (contract ``console``) and the live engine is never touched.
It blocks for as long as the probes take: the console runs it in a thread worker. One at a
time; cancelled (the console quits), the child gets SIGINT, so it stops its engine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vconsole.telemetry.request_trace import Trace, TraceError, read_trace, trace_lines
from vconsole.whatif.calibration import calibration_path, stored, stored_trace_path
from vconsole.whatif.predict import check_calibration

NO_CALIBRATION = "no calibration: step costs fitted on the trace"
STOP_WAIT_S = 30.0          # for the child to stop its engine after SIGINT


def pick(trace: Trace, root: Path) -> tuple[Trace | None, str]:
    """The calibration a prediction on ``trace`` uses (the newest usable one in ``root`` of
    an engine like its own) and a line that says which; (None, why not) without one."""
    unusable = ""
    for path in stored(trace.header, root) if root.is_dir() else []:
        try:
            calib = read_trace(path)
            check_calibration(calib, trace)
        except (TraceError, ValueError, OSError) as e:
            unusable = unusable or f"calibration {path.name} unusable ({e})"
            continue
        return calib, _describe(path, calib)
    return None, (f"{unusable}: step costs fitted on the trace" if unusable
                  else NO_CALIBRATION)


def _describe(path: Path, calib: Trace) -> str:
    stamp = path.name.removesuffix(".calib.jsonl").rsplit("-", 1)[-1]
    when = (f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]} UTC"
            if len(stamp) == 15 else path.name)
    return f"calibrated {when} ({len(calib.steps):,} steps)"


@dataclass(frozen=True)
class Outcome:
    """A finished calibration: ``ok`` and a line to show (its file, or why it failed)."""

    ok: bool
    message: str
    path: Path | None = None


class Calibrator:
    """Runs ``vconsole whatif TRACE --calibrate`` for the console, one at a time."""

    def __init__(self, command: list[str] | None = None) -> None:
        # The console's own interpreter and package: the same vconsole as the console.
        self.command = command or [sys.executable, "-m", "vconsole"]
        self._lock = threading.Lock()
        self.running = False

    def run(self, trace: Trace, root: Path, variant: Mapping[str, Any], *,
            progress: Callable[[str], None],
            cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        """Write ``trace`` to ``root`` and calibrate it for its config and ``variant`` (the
        grid covers the variant's seats and token budget too); ``progress`` gets each line
        the command says. Blocks: a worker thread. RuntimeError when one already runs."""
        with self._lock:
            if self.running:
                raise RuntimeError("a calibration is already running")
            self.running = True
        try:
            return self._run(trace, root, variant, progress, cancelled)
        finally:
            self.running = False

    def _run(self, trace: Trace, root: Path, variant: Mapping[str, Any],
             progress: Callable[[str], None], cancelled: Callable[[], bool]) -> Outcome:
        root.mkdir(parents=True, exist_ok=True)
        path = stored_trace_path(trace.header, root)
        path.write_text("".join(trace_lines(trace)))
        sets = [a for k, v in variant.items() for a in ("--set", f"{k}={v}")]
        argv = [*self.command, "whatif", str(path), "--calibrate", "--no-intervals", *sets]
        started = time.monotonic()
        last = ""
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
            try:
                assert proc.stderr is not None
                watcher = threading.Thread(target=self._stop_when, args=(proc, cancelled),
                                           daemon=True)
                watcher.start()
                for line in proc.stderr:
                    line = line.strip()
                    if line:
                        last = line
                        progress(line)
            except BaseException:   # progress raised (the console closing): stop the child
                self._stop(proc)    # and so its engine; the with closes stderr and waits
                raise
            code = proc.wait()
        took = time.monotonic() - started
        calib = calibration_path(path)
        done = self._outcome(calib, code, last, cancelled(), took)
        if not done.ok:         # half a grid is no calibration: never the newest one
            calib.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        return done

    @staticmethod
    def _outcome(calib: Path, code: int, last: str, cancelled: bool, took: float) -> Outcome:
        if cancelled:
            return Outcome(False, "calibration cancelled")
        if code != 0 or not calib.exists():
            return Outcome(False, f"calibration failed (exit {code}): {last or 'no output'}")
        try:
            steps = len(read_trace(calib).steps)
        except (TraceError, OSError) as e:
            return Outcome(False, f"calibration unusable: {e}")
        return Outcome(True, f"calibrated in {took:.0f} s: {steps:,} steps, kept in {calib}",
                       calib)

    @staticmethod
    def _stop(proc: subprocess.Popen[str]) -> None:
        """SIGINT to the child unless it has exited (it stops its engine on the way out), then
        SIGKILL if it has not exited within `STOP_WAIT_S`."""
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @classmethod
    def _stop_when(cls, proc: subprocess.Popen[str], cancelled: Callable[[], bool]) -> None:
        """`_stop` the child once ``cancelled``."""
        while proc.poll() is None:
            if cancelled():
                cls._stop(proc)
                return
            time.sleep(0.2)
