"""The console's banner while no telemetry has arrived: it names a kernel compile under way on
this machine (an engine's first start) instead of asking whether the engine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vconsole.console.widgets.chrome import Banner, Frame
from vconsole.engine.kernel_cache import BUILDING, COMPILING, ENTRY_PREFIX


def _waiting() -> tuple[str, str]:
    return Banner.message(Frame(now=0.0, mode="live", engine=None, endpoints="tcp://x:1"))


def test_waiting_names_a_kernel_compile_under_way_and_nothing_once_it_is_over(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    monkeypatch.delenv("VCONSOLE_KERNEL_CACHE", raising=False)   # the suite's; not this test's
    assert "is the engine running?" in _waiting()[0]
    entry = tmp_path / "kernels" / f"{ENTRY_PREFIX}abc"
    entry.mkdir(parents=True)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (entry / BUILDING).write_text(json.dumps({"pid": builder.pid, "since": 1.0}))
        text, level = _waiting()
        assert COMPILING in text and "is the engine running?" not in text and level == "warning"
    finally:
        builder.kill()
        builder.wait()
    assert "is the engine running?" in _waiting()[0]      # the builder died: no build now
    assert os.path.exists(entry / BUILDING)
