"""A hung engine tells where it hung: the supervisor's watchdog captures every thread's stack of
the hung child before it kills it, into the engine log, a stacks file and the restart event.

The hang is injected for real: a ``sitecustomize`` on the engine's PYTHONPATH (this test's own
folder; the product has no fault hook) wraps the model runner of the supervised child so that,
once the test creates a trigger file, its next model execution sleeps forever in
``hang_in_the_injected_fault``. The watchdog then sees work pending and no step. The capture
goes through the engine's own SIGUSR2 dump (``VCONSOLE_STACKS_METHOD=signal``), the way that
works on every machine (py-spy needs ptrace; `test_stacks` reads a live engine both ways).

The hang timeout (`HANG_TIMEOUT_S`) is several seconds, not one: on a loaded 2-core machine a
pause of the engine before it reaches the injected function (a scheduling gap, a GC) must not be
taken for the hang, or the reason names another function. The dump folders are the test's own
(``$VCONSOLE_STACKS_DIR``), not the one other engines on this machine share.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.live_engine import Telemetry, ipc_endpoints
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.shared import stacks
from vconsole.wire.ready_file import read_ready_file

HOOK = '''
import os, sys, time
if "--supervised-child" in sys.argv:
    from vconsole.engine.worker import model_runner

    def hang_in_the_injected_fault():
        while True:
            time.sleep(0.05)

    _real = model_runner.ModelRunner.execute_model

    def execute_model(self, scheduler_output):
        trigger = os.environ["VCONSOLE_TEST_HANG_TRIGGER"]
        if os.path.exists(trigger):
            os.unlink(trigger)            # once: the restarted engine serves normally
            hang_in_the_injected_fault()
        return _real(self, scheduler_output)

    model_runner.ModelRunner.execute_model = execute_model
'''

HANG_TIMEOUT_S = 5.0
ENGINE_ARGS = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "16",
               "--set", "heartbeat_interval_s=0.2", "--hang-timeout", str(HANG_TIMEOUT_S),
               "--restart-backoff", "1"]


@pytest.mark.proc
@pytest.mark.slow
def test_a_hung_engine_leaves_its_stacks_in_the_log_the_file_and_the_restart_event(
        tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    trigger = tmp_path / "hang-now"
    cache = tmp_path / "cache"
    monkeypatch.setenv(stacks.DIR_ENV, str(tmp_path / "stacks-root"))   # the engine's, too
    engine = EngineProcess(ENGINE_ARGS, endpoints=ipc_endpoints(tmp_path),
                           log_path=tmp_path / "engine.log",
                           env={"PYTHONPATH": str(hook), "VCONSOLE_CACHE": str(cache),
                                "VCONSOLE_TEST_HANG_TRIGGER": str(trigger),
                                stacks.METHOD_ENV: "signal",
                                stacks.DIR_ENV: str(tmp_path / "stacks-root")})
    with engine:
        first = read_ready_file(engine.ready_path)["child_pid"]
        telemetry = Telemetry(engine.endpoints["telemetry"])
        try:
            with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as client:
                rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=900, ignore_eos=True)
                for out in client.stream(rid, timeout_s=60):
                    assert not out.finished, out
                    if out.new_token_ids:
                        break
                trigger.touch()                     # the next step hangs
                record = _wait_for_restart(engine)
            reason = record["restart_reason"]
            assert reason.startswith("hung: no step for "), reason
            assert " in hang_in_the_injected_fault; stacks: " in reason, reason
            path = Path(reason.split("stacks: ", 1)[1])
            assert path.parent == cache / "stacks" and path.exists()
            text = path.read_text()
            assert f"by {stacks.PYTHON_DUMP}" in text
            # The busy loop's thread first, hung in the injected function, its callers below.
            busy = text.split('Thread "', 2)[1]
            assert busy.startswith("MainThread") and "[busy loop" in busy
            assert busy.index("hang_in_the_injected_fault") < busy.index("run_busy_loop")
            assert "engine-output" in text          # every thread, not only the busy loop
            event = telemetry.wait_for("alert", lambda m: m["name"] == "engine_restart"
                                       and m["level"] == "critical", timeout_s=30)
            assert f"stacks: {path}" in event["message"]
            assert "in hang_in_the_injected_fault" in event["message"]
        finally:
            telemetry.close()
        log = engine.log_text()
        assert "stacks of the hung engine" in log and "hang_in_the_injected_fault" in log
        assert not stacks.live_dir(first).exists(), "the killed child's dump folder is removed"


def _wait_for_restart(engine: EngineProcess, timeout_s: float = 60.0) -> dict:
    """The supervisor's ready record once it counts the restart: it is rewritten with the
    reason as soon as the hung child is killed (no need to wait for the next child's start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = read_ready_file(engine.ready_path)
        if record is not None and record.get("restart_count") == 1:
            return record
        assert engine.child.poll() is None, f"the supervisor exited:\n{engine.log_tail()}"
        time.sleep(0.05)
    raise AssertionError(f"no restart within {timeout_s} s:\n{engine.log_tail()}")
