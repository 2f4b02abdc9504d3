"""`vconsole attach --web`'s server without a browser: which hosts count as loopback, and a real
`WebConsole` on 127.0.0.1 (port 0) in this test's event loop, spoken to over HTTP and websockets
by aiohttp's client, as a page or another site's page would. Each tab's console is a real
process: a few lines of Python that speak textual-serve's prelude and quit on the first byte of
its stdin (the quit meta), so that a tab costs milliseconds, not a Textual app. (The console
itself in a browser: tests/console/test_attach_web.py; the command's flags:
tests/commands/test_attach_web_flags.py.)"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psutil
import pytest

pytest.importorskip("textual_serve", reason="textual-serve is not installed (the web extra)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vconsole.console import web as web_module  # noqa: E402
from vconsole.console.web import (  # noqa: E402
    MAX_CONSOLES,
    STEER_RESERVED,
    WebConsole,
    check_web_host,
    loopback_host,
)
from vconsole.security.bind_policy import RemoteBindRefused  # noqa: E402

TOKEN = "tok-Zq8vXw3-distinctive-7741"
MARK = "vconsole-web-test-console"          # in each fake console's argv, to find them
CONSOLE = [sys.executable, "-c",
           "import sys; sys.stdout.write('__GANGLION__\\n'); sys.stdout.flush(); "
           "sys.stdin.buffer.read(1)", MARK]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "localhost", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert loopback_host(host)
    check_web_host(host, None)          # served without a token: read-only tabs, local only


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gpu-box"])
def test_beyond_loopback_the_token_is_required(host):
    assert not loopback_host(host)
    check_web_host(host, "a-token")
    with pytest.raises(RemoteBindRefused, match="without its token"):
        check_web_host(host, None)
    with pytest.raises(RemoteBindRefused):
        WebConsole(["vconsole"], host=host, token=None)


@dataclass
class Served:
    web: WebConsole
    base: str
    port: int
    session: aiohttp.ClientSession

    async def get(self, path: str = "/", **kw: object) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.session.get(self.base + path.lstrip("/"), allow_redirects=False,
                                    **kw) as r:    # type: ignore[arg-type]
            return r.status, await r.text(), r

    async def ticket_url(self, **kw: object) -> str:
        status, body, _ = await self.get("/", **kw)
        assert status == 200, body
        m = re.search(r'data-session-websocket-url="([^"]+)"', body)
        assert m is not None
        return m.group(1)

    async def steer_cookie(self) -> dict[str, str]:
        status, _, r = await self.get(f"/?token={TOKEN}")
        assert status == 303
        morsel = r.cookies[f"vconsole_token_{self.port}"]
        return {"Cookie": f"{morsel.key}={morsel.value}"}


async def serve(token: str | None = TOKEN) -> tuple[WebConsole, web.AppRunner, int]:
    console = WebConsole(CONSOLE, host="127.0.0.1", port=0, token=token)
    runner = web.AppRunner(await console._make_app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return console, runner, int(runner.addresses[0][1])


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    console, runner, port = await serve()
    # no jar: each request carries exactly the cookie a test gives it
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        try:
            yield Served(console, f"http://127.0.0.1:{port}/", port, session)
        finally:
            await runner.cleanup()


def consoles() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if MARK in p.cmdline():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


async def wait_consoles(n: int, timeout_s: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while len(found := consoles()) != n:
        assert time.monotonic() < deadline, f"{len(found)} consoles, not {n}"
        await asyncio.sleep(0.05)
    return found


async def test_the_token_leaves_the_url_for_a_strict_http_only_cookie(served):
    status, body, r = await served.get(f"/?token={TOKEN}")
    assert status == 303 and r.headers["Location"] == "/"
    assert TOKEN not in body
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    # The cookie is what makes a page steer; a wrong one is none at all (read-only, and dropped).
    url = await served.ticket_url(headers=await served.steer_cookie())
    ticket = served.web._take(url.rsplit("/", 1)[1])
    assert ticket is not None and ticket.steer
    status, body, r = await served.get("/", headers={
        "Cookie": f"vconsole_token_{served.port}=not-{TOKEN}"})
    assert status == 200 and "Max-Age=0" in r.headers.get("Set-Cookie", "")
    m = re.search(r'data-session-websocket-url="[^"]+/ws/([^"]+)"', body)
    assert m is not None
    ticket = served.web._take(m.group(1))
    assert ticket is not None and not ticket.steer
    # A wrong token in the URL is still refused, never downgraded.
    status, body, _ = await served.get(f"/?token=not-{TOKEN}")
    assert status == 403 and "wrong token" in body


async def test_the_page_loads_nothing_from_outside_and_says_so(served):
    status, body, r = await served.get("/")
    assert status == 200
    assert "googleapis" not in body and "https://" not in body
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert f"connect-src 'self' ws://127.0.0.1:{served.port}" in csp
    assert r.headers["Cache-Control"] == "no-store"


async def test_loading_pages_locks_no_one_out(served):
    """Tickets are signed, not stored: a flood of page loads holds nothing."""
    for _ in range(200):
        status, _, _ = await served.get("/")
        assert status == 200
    assert served.web._used == {}
    url = await served.ticket_url(headers=await served.steer_cookie())
    async with served.session.ws_connect(url):
        await wait_consoles(1)
    await wait_consoles(0)


async def test_a_ticket_is_single_use_and_cannot_be_forged(served):
    url = await served.ticket_url()
    async with served.session.ws_connect(url):
        await wait_consoles(1)
    with pytest.raises(aiohttp.WSServerHandshakeError) as used:
        await served.session.ws_connect(url)
    assert used.value.status == 403
    # The rights are signed: a read-only ticket turned into a steering one is refused.
    import base64
    body, sig = url.rsplit("/", 1)[1].split("~")
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    forged = base64.urlsafe_b64encode(b"1" + raw[1:]).rstrip(b"=").decode() + "~" + sig
    assert served.web._take(forged) is None
    assert served.web._take("junk") is None


async def test_another_site_opens_no_console(served):
    status, body, _ = await served.get("/", headers={"Sec-Fetch-Site": "cross-site"})
    assert status == 403 and "another site" in body
    assert (await served.get("/", headers={"Sec-Fetch-Site": "same-origin"}))[0] == 200
    for origin in ("http://attacker.example", f"http://localhost:{served.port}",
                   f"http://127.0.0.1:{served.port + 1}", "null"):
        url = await served.ticket_url()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await served.session.ws_connect(url, origin=origin)
        assert refused.value.status == 403, origin
    url = await served.ticket_url()
    async with served.session.ws_connect(url, origin=f"http://127.0.0.1:{served.port}"):
        await wait_consoles(1)


async def test_read_only_tabs_leave_room_for_the_token_holder(served):
    readonly_room = MAX_CONSOLES - STEER_RESERVED
    sockets = []
    try:
        # the client's sizes are clamped, and the console's environment has no token
        sockets.append(await served.session.ws_connect(
            (await served.ticket_url()) + "?width=99999&height=-5"))
        (first,) = await wait_consoles(1)
        env = first.environ()
        assert (env["COLUMNS"], env["ROWS"]) == ("1000", "1")
        assert not any(TOKEN in v for v in env.values())
        assert not any(TOKEN in a for a in first.cmdline())
        for _ in range(readonly_room - 1):
            sockets.append(await served.session.ws_connect(await served.ticket_url()))
        await wait_consoles(readonly_room)
        with pytest.raises(aiohttp.WSServerHandshakeError) as full:
            await served.session.ws_connect(await served.ticket_url())
        assert full.value.status == 503
        cookie = await served.steer_cookie()
        for _ in range(STEER_RESERVED):
            sockets.append(await served.session.ws_connect(
                await served.ticket_url(headers=cookie)))
        await wait_consoles(MAX_CONSOLES)
        with pytest.raises(aiohttp.WSServerHandshakeError) as full:
            await served.session.ws_connect(await served.ticket_url(headers=cookie))
        assert full.value.status == 503
    finally:
        for ws in sockets:
            await ws.close()
    await wait_consoles(0)


async def test_a_stopped_console_cannot_hang_the_shutdown(monkeypatch):
    monkeypatch.setattr(web_module, "STOP_S", 1.0)
    console, runner, port = await serve()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/") as r:
            url = re.search(r'data-session-websocket-url="([^"]+)"', await r.text())
        assert url is not None
        ws = await session.ws_connect(url.group(1))
        (proc,) = await wait_consoles(1)
        assert proc.ppid() == os.getpid()          # run directly: no /bin/sh in between
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        await asyncio.wait_for(runner.cleanup(), 20)
        assert time.monotonic() - started < 10
        await ws.close()
    assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
