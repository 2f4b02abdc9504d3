"""`vconsole attach --web` in a real browser: a real engine, the real command serving it
through textual-serve, and Debian's headless Chromium driven by selenium, pressing keys as a
person would and reading what xterm.js put on screen.

Reading the screen: textual-serve's page draws the terminal on a canvas (xterm.js's WebGL or
canvas renderer), so there are no DOM rows to read. Before the page loads, the test adds a
script that notes each xterm.js ``Terminal`` as it is made (the moment it sets its ``_core``),
then reads the terminal's own buffer: the text xterm.js decoded from the console's output.

The session's shared engine (the one config key a tab changes is put back), one server and one
browser for the module; the browser tests are skipped, saying what to install, where chromium or
chromedriver is missing (`make install-test` installs them as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]

# The README's picture of the web console: rewritten by this test only when asked
# (VCONSOLE_SCREENSHOTS=1, as `make screenshots` sets), so a test run leaves the tree clean.
SCREENSHOT = Path(__file__).resolve().parents[2] / "screenshots" / "web.png"
WINDOW = "1440,900"

# Notes every xterm.js Terminal as it sets its _core (its public API: buffer, rows, loadAddon).
NOTE_TERMINALS = """
Object.defineProperty(Object.prototype, '_core', {
  configurable: true,
  get() { return undefined; },
  set(value) {
    Object.defineProperty(this, '_core', {value, writable: true, configurable: true,
                                          enumerable: true});
    if (typeof this.loadAddon === 'function') {
      (window.__terminals = window.__terminals || []).push(this);
    }
  },
});
"""
SCREEN_TEXT = """
const t = (window.__terminals || [])[0];
if (!t) return null;
const b = t.buffer.active, rows = [];
for (let i = 0; i < t.rows; i++) {
  const line = b.getLine(b.viewportY + i);
  rows.push(line ? line.translateToString(true) : '');
}
return rows.join('\\n');
"""


# --- the engine, its load, the server ---------------------------------------------------------

KEY = "alert_waiting_warning"           # a hot key a tab changes: a threshold, harmless


@pytest.fixture(scope="module")
def engine(shared_engine) -> Iterator[EngineProcess]:
    """The shared engine; ``KEY`` back to its value afterwards, whatever the tests did."""
    with control(shared_engine) as ctl:
        before = ctl.get_config()["values"][KEY]
    yield shared_engine
    with control(shared_engine) as ctl:
        ctl.set_config({KEY: before})


@pytest.fixture(scope="module")
def started_config(engine) -> dict[str, Any]:
    """The engine's config values as the tests start."""
    with control(engine) as ctl:
        return dict(ctl.get_config()["values"])


def control(engine: EngineProcess) -> ControlClient:
    key = engine.control_key()
    assert key, f"no control key at {engine.control_key_file}"
    return ControlClient(engine.endpoints["control"], timeout_s=5.0, key=key)


@pytest.fixture(scope="module")
def load(engine) -> Iterator[None]:
    """A light, steady load (four requests at a time) so that the figures move."""
    stop = threading.Event()

    def run() -> None:
        with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
            i = 0
            while not stop.is_set():
                ids = [c.submit(prompt_token_ids=[3 + (i + k) % 200] * (8 + k), max_tokens=16,
                                ignore_eos=True) for k in range(4)]
                with contextlib.suppress(TimeoutError):   # a crowded machine: never mind
                    c.gather(ids, timeout_s=30)
                i += 4

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(30)


class WebServer:
    """``vconsole attach --web`` as a process; ``lines`` is what it printed."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "vconsole", "attach", "--web", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout_s: float = 30.0) -> WebServer:
        deadline = time.monotonic() + timeout_s
        while not any(line.lstrip().startswith(("steering tab:", "--no-token:"))
                      for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no URL printed: {self.lines}")
            time.sleep(0.05)
        return self

    @property
    def base(self) -> str:
        return re.search(r"(http://\S+/)", self.lines[0]).group(1)   # type: ignore[union-attr]

    @property
    def token(self) -> str:
        text = "\n".join(self.lines)
        return re.search(r"\?token=([\w-]+)", text).group(1)   # type: ignore[union-attr]

    def consoles(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[WebServer]:
    web = WebServer(["--port", "0", "--telemetry", engine.endpoints["telemetry"],
                     "--control", engine.endpoints["control"]]).wait_ready()
    yield web
    web.stop()


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, body, _ = http_response(url, headers)
    return status, body


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None          # a 303 is the answer the test reads, not a page to go on to


def http_response(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    """Status, body and headers of a GET (a redirect is answered, not followed)."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def websocket_status(url: str) -> int:
    """The HTTP status a websocket handshake to ``url`` gets (101 once upgraded)."""
    import aiohttp

    async def connect() -> int:
        async with aiohttp.ClientSession() as s:
            try:
                async with s.ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_close=2)):
                    return 101
            except aiohttp.WSServerHandshakeError as e:
                return e.status

    return asyncio.run(connect())


# --- the browser --------------------------------------------------------------------------------

class Tab:
    """The browser's one tab: open a URL, press keys into xterm.js, read its screen."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def open(self, url: str) -> Tab:
        self.driver.get(url)
        return self

    def text(self) -> str:
        return self.driver.execute_script(SCREEN_TEXT) or ""

    def wait_for(self, what: str, cond: Callable[[str], bool], timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            if cond(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"not on screen within {timeout_s:g} s: {what}\n{text}")
            time.sleep(0.2)

    def shows(self, *parts: str, timeout_s: float = 30.0) -> str:
        return self.wait_for(" and ".join(map(repr, parts)),
                             lambda text: all(p in text for p in parts), timeout_s)

    def press(self, *keys: str) -> None:
        """Keys as one burst: the console reads them as they come, in order. A key that moves
        the focus (``/`` opens an input) takes effect only after the burst: use `filter`."""
        from selenium.webdriver.common.by import By

        self.driver.find_element(By.CSS_SELECTOR, ".xterm-helper-textarea").send_keys(*keys)

    def filter(self, words: str) -> str:
        """``/``, then (once the filter input is open) ``words`` and enter."""
        self.press("/")
        self.shows("filter keys")
        self.press(words, "\n")
        return self.shows(f"filter {words}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Tab]:
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"no {' or '.join(missing)} on PATH: apt-get install chromium "
                    "chromium-driver (make install-test does it as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={WINDOW}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                               {"source": NOTE_TERMINALS})
        yield Tab(driver)
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def readonly_tab(browser, server, load, started_config) -> Tab:
    """The page opened without the token, its console showing the engine: its id, its KV
    pool's size."""
    browser.open(server.base).shows(started_config["engine_id"],
                                    f"/{started_config['num_kv_blocks']}")
    return browser


# --- tests ----------------------------------------------------------------------------------------

def finished(text: str) -> int:
    """The Overview's "finished 2,448" count."""
    m = re.search(r"finished ([\d,]+)", text)
    return int(m.group(1).replace(",", "")) if m else 0


def test_a_tab_shows_the_engines_figures_and_switches_screens_by_key(readonly_tab, engine,
                                                                     started_config, tmp_path):
    with control(engine) as ctl:
        config = ctl.get_config()
    tab = readonly_tab
    tab.press("4")
    tab.shows(f"config v{config['version']}", f"{len(config['schema'])} keys", "max_num_seqs")
    tab.press("3")
    tab.shows(f"{started_config['num_kv_blocks']} blocks × ")
    tab.press("1")
    text = tab.wait_for("requests finished under load", lambda t: finished(t) > 8)
    assert "Queues" in text and "KV cache" in text
    shot = SCREENSHOT if os.environ.get("VCONSOLE_SCREENSHOTS") == "1" else tmp_path / "web.png"
    shot.parent.mkdir(exist_ok=True)
    assert tab.driver.save_screenshot(str(shot)) and shot.stat().st_size > 0


def test_a_tab_opened_without_the_token_is_read_only(readonly_tab, engine):
    with control(engine) as ctl:
        value = ctl.get_config()["values"][KEY]
    tab = readonly_tab
    assert "read-only" in tab.text().splitlines()[0]          # the tab bar says so
    tab.press("4")
    tab.shows("config v")
    assert "read-only: --readonly" in tab.filter(KEY)
    # With an editor open, "1" would be typed into it; here it switches to the Overview.
    tab.press("e", "1")
    assert "enter sends" not in tab.shows("Queues")
    with control(engine) as ctl:
        assert ctl.get_config()["values"][KEY] == value


def test_a_tab_opened_with_the_token_changes_the_config(browser, server, engine,
                                                        started_config):
    from selenium.webdriver.common.keys import Keys

    with control(engine) as ctl:
        value = ctl.get_config()["values"][KEY]
    new = value + 27
    tab = browser.open(f"{server.base}?token={server.token}")
    assert "read-only" not in tab.shows(started_config["engine_id"]).splitlines()[0]
    assert tab.driver.current_url == server.base      # the token left the URL for a cookie
    tab.press("4")
    tab.shows("config v")
    tab.filter(KEY)
    tab.press("e")
    tab.shows(f"{KEY} = {value}", "enter sends")
    tab.press(Keys.END, Keys.BACKSPACE * len(str(value)))
    tab.wait_for("the editor emptied", lambda t: re.search(rf"{KEY} = +enter sends", t))
    tab.press(str(new))
    tab.shows(f"{KEY} = {new}")
    tab.press(Keys.ENTER)
    # The engine's reply in the change list: "applied" alone is also in the key's help line
    # ("hot: applied between two steps"), which matched while the change was still pending.
    tab.shows(f"{KEY} {value} → {new}: applied")
    with control(engine) as ctl:
        assert ctl.get_config()["values"][KEY] == new


def test_a_wrong_token_a_used_ticket_or_a_foreign_host_is_refused(browser, server):
    status, body = http_get(f"{server.base}?token=not-{server.token}")
    assert status == 403 and "wrong token" in body
    # The ticket of the page the browser holds was used by its console: never again.
    used = re.search(r'data-session-websocket-url="([^"]+)"', browser.driver.page_source)
    assert used is not None
    assert websocket_status(used.group(1)) == 403
    # A page of another name that resolves here (DNS rebinding) gets nothing.
    port = server.base.rstrip("/").rsplit(":", 1)[1]
    status, body = http_get(server.base, {"Host": f"attacker.example:{port}"})
    assert status == 403 and "only to loopback names" in body
    assert sum(server.token in line for line in server.lines) == 1   # printed once, at start


def test_beyond_loopback_every_page_needs_the_token(engine, capsys):
    from vconsole.cli import main

    assert main(["attach", "--web", "--host", "0.0.0.0", "--no-token"]) == 2
    assert ("refusing to serve the console on non-loopback host '0.0.0.0' without its token"
            in capsys.readouterr().err)
    web = WebServer(["--host", "0.0.0.0", "--port", "0", "--telemetry",
                     engine.endpoints["telemetry"], "--control", engine.endpoints["control"]])
    try:
        web.wait_ready()
        assert not any("read-only tab" in line for line in web.lines)
        local = "http://127.0.0.1:" + web.base.rsplit(":", 1)[1]   # PORT/
        status, body = http_get(local)
        assert status == 403 and "open it with its token" in body
        status, _, headers = http_response(f"{local}?token={web.token}")
        assert status == 303 and headers["Location"] == "/"   # the token leaves the URL
        cookie = headers["Set-Cookie"].split(";", 1)[0]
        status, body, headers = http_response(local, {"Cookie": cookie})
        assert status == 200 and "/ws/" in body
        assert headers["Referrer-Policy"] == "no-referrer"     # the token stays in the tab
        assert headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    finally:
        assert web.stop() == 0


def test_stopping_the_server_ends_every_console(engine):
    """On a server of its own (the module's stays up for the tests after it), with one console
    started by a websocket as a page's would, without the browser."""
    import aiohttp

    web = WebServer(["--port", "0", "--telemetry", engine.endpoints["telemetry"],
                     "--control", engine.endpoints["control"]]).wait_ready()

    async def run() -> list[psutil.Process]:
        async with aiohttp.ClientSession() as s:
            async with s.get(web.base) as r:
                m = re.search(r'data-session-websocket-url="([^"]+)"', await r.text())
            assert m is not None
            async with s.ws_connect(m.group(1)) as ws:
                # the console's first screen: it runs, and reads its stdin (the quit)
                msg = await ws.receive(timeout=60)
                assert msg.type == aiohttp.WSMsgType.BINARY, msg
                consoles = web.consoles()
                assert consoles, "the socket's console runs under the server"
                started = time.monotonic()
                assert await asyncio.to_thread(web.stop) == 0
                assert time.monotonic() - started < 5, "a running console quits when told"
                return consoles

    try:
        consoles = asyncio.run(run())
    finally:
        web.stop()
    gone, alive = psutil.wait_procs(consoles, timeout=10)
    assert not alive, f"consoles left running: {[p.pid for p in alive]}"
