"""`Calibrator.run`'s child process: when the console stops listening mid-run (its progress
callback raises, as when the app closes), the child gets SIGINT, so it stops its engine,
instead of running on with nobody reading it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from vconsole.console.calibrating import Calibrator
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.request_trace import Trace, TraceHeader

pytestmark = pytest.mark.proc

# Stands in for `vconsole whatif TRACE --calibrate`: says a line every 0.1 s; on SIGINT it
# notes that it stopped (where our engine would be stopped) and exits.
CHILD = """
import os, signal, sys, time
out = sys.argv[1]
def stop(*_):
    open(out + ".stopped", "w").close()
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
open(out + ".pid", "w").write(str(os.getpid()))
for i in range(600):
    print(f"probe {i}", file=sys.stderr, flush=True)
    time.sleep(0.1)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_progress_that_raises_stops_the_child(tmp_path: Path) -> None:
    out = tmp_path / "child"
    calibrator = Calibrator([sys.executable, "-c", CHILD, str(out)])
    config = EngineConfig()
    trace = Trace(TraceHeader(model="tiny", block_size=config.block_size, num_kv_blocks=8,
                              vocab_size=256, max_model_len=2048, config=config.to_dict()), [])

    def progress(line: str) -> None:
        raise RuntimeError("the console is closing")

    with pytest.raises(RuntimeError, match="closing"):
        calibrator.run(trace, tmp_path / "calibrations", {}, progress=progress)
    pid = int((out.with_suffix(".pid")).read_text())
    try:
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the calibration's child ran on after the console went"
        assert out.with_suffix(".stopped").exists()      # by SIGINT: it stopped its engine
        assert not calibrator.running
    finally:
        if alive(pid):
            os.kill(pid, 9)
