"""``--readonly`` is more than a UI that hides the actions: the console holds no control key and
writes no recording (a browser tab opened without the token runs with it: any local user's)."""

from __future__ import annotations

from vconsole.console.app import VConsoleApp
from vconsole.console.state import ConsoleState
from vconsole.console.steering import Steering


def test_a_readonly_console_holds_no_key(tmp_path):
    key_file = tmp_path / "control.key"
    key_file.write_text("k" * 64)
    key_file.chmod(0o600)
    endpoint = f"ipc://{tmp_path}/control"
    steering = Steering.connect(ConsoleState(), control_endpoint=endpoint, readonly=True,
                                control_key_file=key_file, control_key="given-key")
    assert steering.readonly_reason == "--readonly"
    assert steering.control is not None                     # it still reads the config
    assert getattr(steering.control, "key", None) is None
    assert getattr(steering.control, "key_file", None) is None
    writable = Steering.connect(ConsoleState(), control_endpoint=endpoint,
                                control_key="given-key")
    assert getattr(writable.control, "key", None) == "given-key"


async def test_r_records_nothing_in_a_readonly_console(tmp_path):
    app = VConsoleApp(telemetry_endpoints=[f"ipc://{tmp_path}/no-engine"], readonly=True,
                      record_dir=tmp_path / "recordings")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("R")
        await pilot.pause()
        assert not app.sources[0].recording
        assert any("--readonly writes no files" in str(n.message)
                   for n in app._notifications)
    assert not (tmp_path / "recordings").exists()
