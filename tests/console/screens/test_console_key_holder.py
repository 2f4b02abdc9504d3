"""The Config screen says whose control key the console holds: the engine id and pid from the
key's owner record, marked when that engine is gone or is not the engine answering."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from textual.widgets import Static

from vconsole.console.app import VConsoleApp
from vconsole.console.screens.config import key_holder
from vconsole.security import engine_key, key_owner
from vconsole.security.key_owner import GONE, RUNNING, UNRECORDED, KeyOwner, KeyStatus

OWNER = KeyOwner(4242, 1.0, "here", "eng-0", "ipc:///x/control", "0" * 16)


def test_the_holder_names_the_engine_and_flags_a_gone_or_different_one():
    assert key_holder(None) == ""
    assert "key eng-0 pid 4242" in key_holder(KeyStatus(RUNNING, OWNER), "eng-0")
    assert "$error" in key_holder(KeyStatus(GONE, OWNER)) and "gone" in key_holder(
        KeyStatus(GONE, OWNER))
    assert "≠ engine eng-1" in key_holder(KeyStatus(RUNNING, OWNER), "eng-1")
    assert "engine unknown" in key_holder(KeyStatus(UNRECORDED))


@pytest.mark.slow
async def test_a_key_left_by_a_killed_engine_is_shown_as_gone(tmp_path):
    """No engine at all: the console holds the key file a dead engine left behind."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    control = f"ipc://{tmp_path}/control"
    path = tmp_path / "control.key"
    key = engine_key.new_key()
    record = {**json.loads(KeyOwner.for_this_process(key, engine_id="old-0",
                                                     endpoint=control).to_json()),
              "pid": dead.pid, "started": time.time() - 60}
    key_owner.owner_path(path).write_text(json.dumps(record))
    engine_key.write_key_file(path, key)

    app = VConsoleApp(telemetry_endpoints=[f"ipc://{tmp_path}/telemetry"],
                      control_endpoint=control, control_key_file=path, control_timeout_s=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        deadline = time.monotonic() + 10
        while app.steering.key_status is None:
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        app.refresh_view(force=True)
        await pilot.pause()
        summary = str(app.screen.query_one("#cfg-summary", Static).render())
    assert app.steering.key_status.state == GONE
    assert f"key old-0 pid {dead.pid} gone" in summary
