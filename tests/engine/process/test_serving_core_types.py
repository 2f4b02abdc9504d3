"""`ServingCore` is a Protocol the type checker enforces: mypy accepts the real `EngineCore`
and a fake with every member, and refuses a fake that lacks one, wherever a `ServingCore` is
expected (the engine process, `RequestIntake`, `ProfileBook`).

The fakes are made from the Protocol's own source (its body, one member left out or not), so
this test follows the Protocol as it grows. mypy runs in a subprocess over a temporary file, with
the repository's cache (a few seconds once warm).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vconsole.engine.process.serving_core import ServingCore

ROOT = Path(__file__).resolve().parents[3]
LEFT_OUT = "detokenize"


def fake_source(leave_out: str | None) -> str:
    """A plain class with the Protocol's body, ``leave_out``'s definition dropped."""
    body = inspect.getsource(ServingCore).split("\n", 1)[1]
    if leave_out is not None:
        body, n = re.subn(rf"    def {leave_out}\(self.*?\.\.\.\n", "", body, flags=re.S)
        assert n == 1, f"no method {leave_out} in ServingCore"
    return f"class {'FakeLacking' if leave_out else 'FakeComplete'}:\n{body}"


def mypy(source: str, tmp_path: Path) -> str:
    path = tmp_path / "fake_cores.py"
    path.write_text(source)
    run = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports",
                          "--follow-imports=silent", "--no-error-summary", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    return run.stdout + run.stderr


@pytest.mark.slow
def test_mypy_accepts_the_real_core_and_refuses_a_fake_missing_one_member(tmp_path):
    source = textwrap.dedent("""\
        # mypy: disable-error-code="empty-body"
        from __future__ import annotations

        from collections.abc import Callable, Iterable
        from typing import Any
        import queue

        from vconsole.engine.core import EngineCore
        from vconsole.engine.latency import LatencyBatch
        from vconsole.engine.process.profile_book import ProfileBook
        from vconsole.engine.process.request_intake import RequestIntake
        from vconsole.engine.process.serving_core import ServingCore
        from vconsole.engine.request import Request
        from vconsole.engine.sched.scheduler import RowSource
        from vconsole.engine.telemetry_guard import TelemetryGuard
        from vconsole.engine.worker.profiler import StepProfiler
        from vconsole.shared.config import ConfigUpdate, EngineConfig
        from vconsole.shared.kv_events import KVEvent
        from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats
        from vconsole.wire.outputs import RequestOutput
        from vconsole.wire.sampling import SamplingParams


        """) + fake_source(None) + "\n\n" + fake_source(LEFT_OUT) + textwrap.dedent("""\


        def real(core: EngineCore) -> ServingCore:
            return core


        def complete(core: FakeComplete) -> ServingCore:
            return core


        def lacking(core: FakeLacking) -> ServingCore:
            return core                                           # line A


        def intake(core: FakeLacking) -> RequestIntake:
            return RequestIntake(core, queue.SimpleQueue(), queue.SimpleQueue())   # line B


        def profile(core: FakeLacking) -> None:
            ProfileBook().start(core, 3)                          # line C
        """)
    out = mypy(source, tmp_path)
    lines = source.splitlines()
    errors = [ln for ln in out.splitlines() if ": error:" in ln]
    where = sorted({int(ln.split(":")[1]) for ln in errors})
    marked = sorted(i + 1 for i, ln in enumerate(lines) if re.search(r"# line [ABC]$", ln))
    assert where == marked, out                  # exactly the three uses of the lacking fake
    assert all('"FakeLacking"' in ln and '"ServingCore"' in ln for ln in errors), out
    assert '"FakeLacking" is missing following "ServingCore" protocol member' in out, out
    assert f"    {LEFT_OUT}" in out, out
