"""The console against a real engine process: Pilot presses keys, and the engine itself — its
control socket and a telemetry subscriber of our own — is the reference for what must be on
screen. No fakes anywhere.

One engine (``live-0``) serves the screen tests in this module; the kill-and-restart test starts
its own engine so that it can take it down. Every engine process is stopped in teardown, also
when a test fails (`EngineProcess.stop`: SIGTERM, then SIGKILL of its process group).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.app import VConsoleApp
from vconsole.console.changes import APPLIED, REJECTED, show_value, validate
from vconsole.console.screens.config import ConfigScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.widgets.chrome import Banner, TabBar
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security import engine_key
from vconsole.telemetry import schema
from vconsole.telemetry.listener import TelemetryListener
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]

SIZES = [(80, 24), (120, 40)]
ENGINE_ID = "live-0"
NUM_BLOCKS = 48
MAX_NUM_SEQS = 8
HEARTBEAT_S = 0.2


def engine_args(engine_id: str = ENGINE_ID, max_num_seqs: int = MAX_NUM_SEQS) -> list[str]:
    return ["--model", "tiny", "--num-kv-blocks", str(NUM_BLOCKS),
            "--max-num-seqs", str(max_num_seqs), "--policy", "priority",
            "--set", f"engine_id={engine_id}", "--set", f"heartbeat_interval_s={HEARTBEAT_S}",
            "--set", "telemetry_hz=20"]


# --- processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("console-live")


@pytest.fixture(scope="module")
def spawn(workdir) -> Iterator[Callable[..., EngineProcess]]:
    """Start ``vconsole engine`` processes sharing one model cache (the tiny model is built once);
    all of them are stopped at the end of the module, whatever happened."""
    env = {"VCONSOLE_CACHE": str(workdir / "cache"), "HF_HUB_OFFLINE": "1"}
    started: list[EngineProcess] = []

    def start(args: list[str], endpoints: dict[str, str] | None = None) -> EngineProcess:
        proc = EngineProcess(args, endpoints=endpoints, env=env,
                             log_path=workdir / f"engine-{len(started)}.log")
        started.append(proc)
        proc.start(timeout_s=60)
        wait_for_control(proc.endpoints["control"])
        return proc

    yield start
    for proc in started:
        proc.stop(grace_s=5)


def wait_for_control(endpoint: str, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    with ControlClient(endpoint, timeout_s=1.0) as ctl:
        while True:
            try:
                return ctl.get_config()
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


@pytest.fixture(scope="module")
def engine(spawn) -> EngineProcess:
    return spawn(engine_args())


class Telemetry:
    """The latest payload per topic, from a SUB socket of our own."""

    def __init__(self, endpoint: str) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on_message)

    def _on_message(self, msg: schema.TelemetryMessage) -> None:
        payload = {k: v for k, v in msg.payload.items() if k != "block_states"}
        with self.lock:
            self.latest[msg.topic] = payload

    def get(self, topic: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.latest.get(topic) or {})

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(scope="module")
def telemetry(engine) -> Iterator[Telemetry]:
    t = Telemetry(engine.endpoints["telemetry"])
    yield t
    t.close()


def control(proc: EngineProcess) -> ControlClient:
    """A control client holding the engine's key (same machine, as `vconsole set` finds it)."""
    key = proc.control_key()
    assert key, f"no control key at {proc.control_key_file}"
    return ControlClient(proc.endpoints["control"], timeout_s=5.0, key=key)


def console_for(proc: EngineProcess, **kw: Any) -> VConsoleApp:
    """A console as `vconsole attach` makes it: it finds the key by the control endpoint."""
    return VConsoleApp(telemetry_endpoints=[proc.endpoints["telemetry"]],
                       control_endpoint=proc.endpoints["control"], **kw)


class Load:
    """Requests sent from a thread (the UI's event loop must not block on the engine)."""

    def __init__(self, proc: EngineProcess, n: int, max_tokens: int = 8) -> None:
        self.finished = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(proc, n, max_tokens),
                                         daemon=True)
        self._thread.start()

    def _run(self, proc: EngineProcess, n: int, max_tokens: int) -> None:
        try:
            with EngineClient(proc.endpoints["input"], proc.endpoints["output"]) as c:
                for i in range(n):
                    c.submit(prompt_token_ids=[3 + i % 200] * (4 + i % 9), max_tokens=max_tokens,
                             ignore_eos=True, priority=i % 3)
                done = c.gather(timeout_s=60)
                self.finished = sum(1 for d in done.values() if d.finished)
        except BaseException as e:  # reported by the test
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join(60)


# --- pilot helpers --------------------------------------------------------------------------

def text_of(widget: Static) -> str:
    return str(widget.render())


async def until(pilot, cond: Callable[[], Any], what: str, timeout: float = 15.0,
                why: Callable[[], Any] | None = None) -> None:
    """Poll ``cond`` between short pilot pauses; fail with ``what`` (and ``why()``, the state
    that explains it) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}"
                                 + (f" ({why()!r})" if why else ""))
        await pilot.pause(0.1)


def banner_text(app: VConsoleApp) -> str:
    banner = app.screen.query_one(Banner)
    return text_of(banner) if banner.has_class("-shown") else ""


async def open_config_key(pilot, app: VConsoleApp, key: str) -> ConfigScreen:
    """As a person would: 4 for the Config screen, / to filter down to the key, e to edit."""
    await pilot.press("4")
    await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None,
                "the console fetched the config")
    screen = app.screen
    assert isinstance(screen, ConfigScreen)
    await pilot.press("slash", *key, "enter")
    await until(pilot, lambda: screen.selected_key() == key, f"{key} selected")
    await pilot.press("e")
    assert screen.editing == key
    return screen


async def type_over(pilot, text: str) -> None:
    """Clear the edit box (home, ctrl+k) and type ``text``, then enter."""
    await pilot.press("home", "ctrl+k", *text, "enter")


# --- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
async def test_numbers_on_screen_match_the_engine(engine, telemetry, size):
    cfg = wait_for_control(engine.endpoints["control"])
    values = cfg["values"]
    app = console_for(engine)
    async with app.run_test(size=size) as pilot:
        load = Load(engine, 12)
        await until(pilot, lambda: load.done, "the load finished", timeout=60)
        assert load.error is None and load.finished == 12, load.error

        # The engine drained: its own figures are now stable, so the screen can be compared
        # with them exactly.
        def idle() -> bool:
            sc, kv, h = telemetry.get("sched"), telemetry.get("kv"), telemetry.get("health")
            return (sc.get("num_running") == 0 and sc.get("num_waiting") == 0
                    and kv.get("num_used") == 0 and h.get("state") == "idle")
        await until(pilot, idle, "the engine reported itself idle")
        sc, kv = telemetry.get("sched"), telemetry.get("kv")
        finished = sc["num_finished_total"]

        def console_caught_up() -> bool:
            eng = app.state.engine()
            return (eng is not None and app.state.config is not None
                    and eng.latest.get("sched", {}).get("num_finished_total") == finished
                    and eng.latest.get("kv", {}).get("num_used") == 0
                    and eng.latest.get("health", {}).get("state") == "idle")
        await until(pilot, console_caught_up, "the console heard the same figures")
        app.refresh_view(force=True)
        await pilot.pause()

        assert isinstance(app.screen, OverviewScreen)
        eng = app.state.engine()
        assert eng.key == f"{ENGINE_ID}/0"
        summary = text_of(app.screen.query_one("#summary"))
        assert ENGINE_ID in summary and "idle" in summary
        assert "● idle" in text_of(app.screen.query_one(TabBar))
        assert banner_text(app) == ""
        queues = text_of(app.screen.query_one("#queues"))
        assert f"0/{values['max_num_seqs']}" in queues
        assert f"finished {fmt.count(finished)}" in queues
        assert sc["max_num_seqs"] == values["max_num_seqs"] == MAX_NUM_SEQS
        kvt = text_of(app.screen.query_one("#kv"))
        assert kv["num_blocks"] == values["num_kv_blocks"] == NUM_BLOCKS
        assert f"0/{fmt.count(kv['num_blocks'])}" in kvt
        assert f"free {fmt.count(kv['num_free'])}" in kvt
        if size[0] >= 100:  # the detail lines drop their tail parts at 80 columns
            assert sc["policy"] == values["policy"] == "priority"
            assert "priority" in queues
            assert f"{kv['block_size']} tok/block" in kvt

        # The Config screen shows the engine's effective config, value for value.
        await pilot.press("4")
        await until(pilot, lambda: app.steering.config_fetches >= 1, "the config was fetched")
        app.refresh_view(force=True)
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ConfigScreen)
        assert f"config v{cfg['version']}" in text_of(screen.query_one("#cfg-summary"))
        for key in ("engine_id", "max_num_seqs", "num_kv_blocks", "policy",
                    "heartbeat_interval_s", "block_size", "alert_waiting_warning"):
            assert str(screen.table.get_row(key)[1]) == show_value(values[key]), key


async def test_config_change_through_the_ui_reaches_the_engine(engine, telemetry):
    before = wait_for_control(engine.endpoints["control"])
    old = before["values"]["max_num_seqs"]
    new = old // 2  # a cut to half or less always asks for confirmation
    app = console_for(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        load = Load(engine, 16, max_tokens=24)  # something running while it changes
        screen = await open_config_key(pilot, app, "max_num_seqs")
        await type_over(pilot, str(new))
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
        modal = app.screen
        assert f"max_num_seqs: {old} → {new}" in modal.title_text
        await pilot.press("tab", "enter")  # to "Apply change", and press it
        await until(pilot, lambda: "max_num_seqs" in app.steering.replies
                    and app.steering.replies["max_num_seqs"].done, "the engine's reply")
        rec = app.steering.replies["max_num_seqs"]
        assert rec.status == APPLIED, rec.summary()

        # The engine has it: read back through the control socket, and in its telemetry.
        with control(engine) as ctl:
            now = ctl.get_config()
        assert now["values"]["max_num_seqs"] == new
        assert now["version"] == rec.version == before["version"] + 1
        await until(pilot, lambda: telemetry.get("sched").get("max_num_seqs") == new,
                    "sched telemetry shows the new max_num_seqs")

        # The ack is on screen: the change history and the key's row.
        app.refresh_view(force=True)
        await pilot.pause()
        assert app.screen is screen
        assert f"applied (v{rec.version})" in text_of(screen.query_one("#cfg-history"))
        row = screen.table.get_row("max_num_seqs")
        assert str(row[1]) == str(new) and "applied" in str(row[3])

        # ...and the Overview's queue panel follows the engine's new limit.
        await pilot.press("1")
        await until(pilot, lambda: f"/{new}" in text_of(app.screen.query_one("#queues")),
                    "the queues panel shows the new limit")
        load.join()
        assert load.error is None and load.finished == 16, load.error
    with control(engine) as ctl:
        assert ctl.set_config({"max_num_seqs": old})["ok"]


async def test_a_value_the_engine_rejects_shows_the_engines_reason(engine):
    before = wait_for_control(engine.endpoints["control"])
    crit = before["values"]["alert_waiting_critical"]
    bad = str(crit + 400)
    assert validate("alert_waiting_warning", bad)[1] is None  # the console's own check passes
    app = console_for(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_config_key(pilot, app, "alert_waiting_warning")
        await type_over(pilot, bad)
        await until(pilot, lambda: "alert_waiting_warning" in app.steering.replies
                    and app.steering.replies["alert_waiting_warning"].done, "the engine's reply")
        rec = app.steering.replies["alert_waiting_warning"]
        assert rec.status == REJECTED
        assert "exceeds critical" in rec.reason and str(crit) in rec.reason
        await pilot.pause()
        error = text_of(screen.query_one("#cfg-error"))
        assert rec.reason in error
        assert "rejected" in str(screen.table.get_row("alert_waiting_warning")[3])
    with control(engine) as ctl:
        after = ctl.get_config()
    assert after["values"] == before["values"] and after["version"] == before["version"]


async def test_a_console_without_the_key_is_read_only_by_itself(engine, tmp_path):
    before = wait_for_control(engine.endpoints["control"])
    missing = tmp_path / "no-such.key"
    app = console_for(engine, control_key_file=missing)
    assert app.readonly and app.readonly_reason == f"no control key: {missing}"
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: app.steering.config_fetches and app.state.config is not None,
                    "the config is still read (get_config needs no key)")
        screen = app.screen
        assert isinstance(screen, ConfigScreen)
        await pilot.press("slash", *"max_num_seqs", "enter")
        await until(pilot, lambda: screen.selected_key() == "max_num_seqs", "key selected")
        assert "e" not in screen.active_bindings
        await pilot.press("e")
        assert screen.editing is None
        refused = app.request_change("max_num_seqs", "3")
        assert refused == f"read-only console (no control key: {missing})"
        app.refresh_view(force=True)
        await pilot.pause()
        assert "read-only" in text_of(screen.query_one("#cfg-summary"))
        assert app.steering.change_log == []
    after = wait_for_control(engine.endpoints["control"])
    assert after["version"] == before["version"] and after["values"] == before["values"]
    # The same console with the key (found by the endpoint, as `attach` does) may edit.
    writable = console_for(engine)
    assert not writable.readonly and writable.readonly_reason == ""
    assert writable.steering.control_key_file == engine.control_key_file


async def test_a_console_started_before_its_engine_takes_the_key_once_it_is_written(spawn,
                                                                                    workdir):
    """No engine yet: read-only, "no control key". The engine comes up on those endpoints and
    writes its key: the console reads it and may edit, without being started again."""
    eps = {n: f"ipc://{workdir}/early-{n}" for n in ("input", "output", "telemetry", "control")}
    app = VConsoleApp(telemetry_endpoints=[eps["telemetry"]], control_endpoint=eps["control"])
    assert app.readonly and app.readonly_reason.startswith("no control key")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.5)      # a fixed wait on purpose: the console runs with no engine
        engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: spawn(engine_args("early-0"), endpoints=eps))
        await until(pilot, lambda: not app.readonly, "the console left read-only mode", 30)
        assert app.readonly_reason == ""
        await open_config_key(pilot, app, "alert_waiting_warning")   # e opens the editor
    assert app.steering.control_key_file == engine.control_key_file


async def test_a_key_the_engine_refuses_makes_the_console_read_only(engine, tmp_path):
    before = wait_for_control(engine.endpoints["control"])
    key = "alert_waiting_warning"
    value = str(before["values"][key] + 1)  # valid, and no confirmation asked
    stale = engine_key.write_key_file(tmp_path / "stale.key", engine_key.new_key())
    app = console_for(engine, control_key_file=stale)
    assert not app.readonly  # it holds a key; only the engine can say it is the wrong one
    async with app.run_test(size=(120, 40)) as pilot:
        await open_config_key(pilot, app, key)
        await type_over(pilot, value)
        await until(pilot, lambda: key in app.steering.replies and app.steering.replies[key].done,
                    "the engine's reply")
        rec = app.steering.replies[key]
        assert not rec.ok and "not authorised" in rec.reason and str(
            engine.control_key_file) in rec.reason
        await until(pilot, lambda: app.readonly, "the console turned read-only")
        assert app.readonly_reason == f"engine refused the control key: {stale}"
        assert "e" not in app.screen.active_bindings
    after = wait_for_control(engine.endpoints["control"])
    assert after["version"] == before["version"] and after["values"] == before["values"]

    # An outdated key in memory with the right file (an engine restarted on the same endpoint
    # writes a new key): the link reads the file again and the change goes through.
    app = console_for(engine, control_key="0" * 64)
    async with app.run_test(size=(120, 40)) as pilot:
        await open_config_key(pilot, app, key)
        await type_over(pilot, value)
        await until(pilot, lambda: key in app.steering.replies and app.steering.replies[key].done,
                    "the engine's reply")
        assert app.steering.replies[key].status == APPLIED, app.steering.replies[key].summary()
        assert not app.readonly
    with control(engine) as ctl:
        assert ctl.set_config({key: before["values"][key]})["ok"]


@pytest.mark.long   # make test-long: ENGINE DOWN and its recovery on screen are test_console_app's
# (synthetic beats); the restart itself is test_supervisor's
async def test_killed_engine_is_shown_down_then_the_console_recovers(spawn):
    first = spawn(engine_args("live-kill"))
    app = console_for(first)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steering.config_fetches == 1 and app.state.engine() is not None
                    and "health" in app.state.engine().latest, "the console is connected")
        await until(pilot, lambda: banner_text(app) == "", "no banner while connected")
        # A change first, so the console holds config v2: the restarted engine counts versions
        # afresh (v1), and its config must still replace the old one.
        with control(first) as ctl:
            assert ctl.set_config({"max_num_seqs": 7})["version"] == 2
        await until(pilot, lambda: app.state.config.version == 2
                    and app.state.config.values["max_num_seqs"] == 7,
                    "the console heard config v2")

        os.killpg(first.child.pid, signal.SIGKILL)
        first.child.wait(10)
        # Down after 3 heartbeat intervals of 0.2 s plus a refresh tick; 4 s is generous.
        await until(pilot, lambda: "ENGINE DOWN" in banner_text(app), "the down banner",
                    timeout=4)
        assert "reconnecting automatically" in banner_text(app)
        assert "● down" in text_of(app.screen.query_one(TabBar))

        # The engine comes back on the same ports, with another config.
        second = await asyncio.to_thread(spawn, engine_args("live-kill", max_num_seqs=6),
                                         first.endpoints)
        assert second.endpoints == first.endpoints
        await until(pilot, lambda: banner_text(app) == "", "the down banner went away",
                    timeout=20)
        await until(pilot, lambda: app.steering.config_fetches >= 2 and app.state.config is not None
                    and app.state.config.values["max_num_seqs"] == 6
                    and app.state.config.version == 1,
                    "the console fetched the new engine's config", timeout=20,
                    why=lambda: (app.steering.config_fetches, app.steering.control_error,
                                 app.state.config and (app.state.config.version,
                                                       app.state.config.origin,
                                                       app.state.config.values["max_num_seqs"]),
                                 [(e.key, e.reconnects, e.restarts, e.process)
                                  for e in app.state.engine_list()]))
        eng = app.state.engine()
        assert eng.reconnects >= 1
        assert eng.status(app.state.now()) in ("running", "idle")
        await until(pilot, lambda: "/6" in text_of(app.screen.query_one("#queues")),
                    "the queues panel shows the new engine's limit")
        assert "● down" not in text_of(app.screen.query_one(TabBar))
