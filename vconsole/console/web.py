"""The console in a browser: `vconsole attach --web` serves `vconsole attach` through
textual-serve, one console process per browser tab.

Who may steer. A tab runs the console exactly as `vconsole attach` with the same endpoint flags
would, as this process's user: it holds the control key when this side does, and is read-only
when it does not. A tab whose page was opened without the token printed at start runs with
``--readonly`` on top (a read-only console loads no key at all, and records nothing). On a
loopback address (the default) anyone on the machine may open a read-only tab; beyond loopback
every page needs the token, and serving there without one (``token=None``) is refused before
anything binds (`check_web_host`). A wrong token is refused, never downgraded to read-only.

The token leaves the URL at once: a page opened with ``?token=`` that matches
(`hmac.compare_digest`) gets an ``HttpOnly; SameSite=Strict`` cookie and a 303 to ``/``; the
cookie is what later pages show. A stale cookie (the token of an earlier start) counts as none.

How a tab's rights reach its process. textual-serve starts its command when the page's
websocket connects, and the websocket does not carry the page's URL. So the page decides: it
mints a ticket naming the tab's rights and puts it in the page's websocket URL (``/ws/TICKET``);
the websocket takes the ticket and starts the console for those rights. A ticket is stateless
(``steer.expiry.nonce`` signed with HMAC-SHA256 under a secret of this process): minting one
costs nothing and holds nothing, so loading pages can lock no one out. It is single use (its
nonce is remembered until it expires) and lives `TICKET_TTL_S`. A page of another site can read
no ticket (same-origin policy); a page load a browser marks ``Sec-Fetch-Site: cross-site`` is
refused, as is a websocket whose ``Origin`` is not this server; on a loopback address a request
whose ``Host`` is not a loopback name is refused, so a DNS-rebound name gets nothing either.

Only live consoles count against `MAX_CONSOLES`, and `STEER_RESERVED` of them are kept for tabs
opened with the token, so read-only tabs cannot shut the token holder out.

The token is printed once, at start, by the caller; it never reaches a log (aiohttp's access log
is off), a console's command line or its environment. textual-serve's ``/download`` route is not
served (the console offers no downloads).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import shlex
import signal
import time
from asyncio.subprocess import Process
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp_jinja2
import jinja2
import yarl
from aiohttp import WSCloseCode, web
from textual_serve.app_service import AppService
from textual_serve.server import Server, to_int

from vconsole.security.bind_policy import RemoteBindRefused
from vconsole.security.endpoints import is_loopback

log = logging.getLogger("vconsole.console.web")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
TICKET_TTL_S = 60.0      # from the page's load to its websocket: textual.js connects at once
MAX_CONSOLES = 16        # console processes at once (each one is a Python process)
STEER_RESERVED = 4       # of them, kept for tabs opened with the token
HEARTBEAT_S = 15.0
STOP_S = 5.0             # a console told to quit gets this long, then is killed
MAX_CELLS = 1000         # a terminal's width or height, as the client gives it
COOKIE = "vconsole_token"
# textual-serve's page loads its font from Google: not from a console's page (no outside site
# learns who watches, and the CSP below allows nothing outside).
OUTSIDE_FONT = re.compile(r'<link[^>]*href="https://fonts\.googleapis\.com[^"]*"[^>]*>\s*')


def clamp_cells(value: object, default: int) -> int:
    """A width or height from the client, as an int in 1..`MAX_CELLS`."""
    return max(1, min(MAX_CELLS, to_int(str(value), default)))


def loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (a wildcard or any other name may be reached from afar)."""
    host = host.strip("[]")
    return is_loopback(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")


def check_web_host(host: str, token: str | None) -> None:
    """Beyond loopback the token is the only thing between the network and the console:
    refuse to serve there without one. Raises `RemoteBindRefused` before anything binds."""
    if token is None and not loopback_host(host):
        raise RemoteBindRefused(
            f"refusing to serve the console on non-loopback host {host!r} without its token "
            "(--no-token): anyone who reaches the port would watch the engine. Drop --no-token "
            "(every tab then needs the token printed at start), or bind 127.0.0.1 and use an "
            "SSH tunnel (ssh -N -L 8765:127.0.0.1:8765 HOST).")


@dataclass(frozen=True)
class Ticket:
    steer: bool          # the page was opened with the token
    expires: float       # time.monotonic()
    nonce: str


class ConsoleProcess(AppService):
    """textual-serve's `AppService` for one tab's console: its argv run directly (no shell per
    tab), the client's sizes clamped, and a stop that cannot hang (a console that does not quit
    within `STOP_S`, a stopped one say, is killed)."""

    def __init__(self, argv: Sequence[str], **kwargs: object) -> None:
        super().__init__(shlex.join(argv), **kwargs)  # type: ignore[arg-type]
        self.argv = list(argv)

    async def _open_app_process(self, width: int = 80, height: int = 24) -> Process:
        environment = self._build_environment(width=width, height=height)
        self._process = process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=environment)
        assert process.stdin is not None
        self._stdin = process.stdin
        return process

    async def set_terminal_size(self, width: int, height: int) -> None:
        await super().set_terminal_size(clamp_cells(width, 80), clamp_cells(height, 24))

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(super().stop(), STOP_S)
        except TimeoutError:
            log.warning("a console did not quit within %g s: killed", STOP_S)
        finally:
            process = self._process
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(process.wait(), STOP_S)
            if self._task is not None and not self._task.done():
                self._task.cancel()


class WebConsole(Server):
    """textual-serve's `Server` with the access rules of the module docstring: its own index
    and websocket routes (the token, the tickets, the Host check), its static files and page
    template, and a run loop that reports the address it bound (``port=0``: a free one)."""

    def __init__(self, command: Sequence[str], *, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, token: str | None = None,
                 title: str = "vconsole") -> None:
        check_web_host(host, token)
        self.base_command = list(command)
        super().__init__(shlex.join(self.base_command), host=host, port=port, title=title)
        self.token = token
        self.loopback = loopback_host(host)
        self._secret = secrets.token_bytes(32)          # signs tickets; this process only
        self._used: dict[str, float] = {}               # nonce → expiry of tickets taken
        self._sockets: dict[web.WebSocketResponse, bool] = {}   # live consoles → steer

    def argv_for(self, steer: bool) -> list[str]:
        """The console's argv for a tab: read-only unless its page had the token."""
        argv = list(self.base_command)
        if not steer and "--readonly" not in argv:
            argv.append("--readonly")
        return argv

    def command_for(self, steer: bool) -> str:
        """`argv_for` as one line (what a log may show)."""
        return shlex.join(self.argv_for(steer))

    # --- access -----------------------------------------------------------------------------

    def _check_host(self, request: web.Request) -> None:
        try:
            name = request.url.host or ""
        except ValueError:
            raise web.HTTPBadRequest(text="bad Host header\n") from None
        if self.loopback and not loopback_host(name):
            raise web.HTTPForbidden(text=f"this console answers only to loopback names, not "
                                         f"{request.host!r}\n")

    def _token_matches(self, given: str | None) -> bool:
        return (given is not None and self.token is not None
                and hmac.compare_digest(given.encode(), self.token.encode()))

    def may_steer(self, request: web.Request) -> bool:
        """Whether the page may steer: True with the right token (in the URL or the cookie),
        False without one on a loopback address; refused (403) with a wrong one in the URL, or
        without one beyond loopback."""
        given = request.query.get("token")
        if given is not None:
            if not self._token_matches(given):
                raise web.HTTPForbidden(text="wrong token: open the URL `vconsole attach "
                                             "--web` printed when it started\n")
            return True
        if self._token_matches(request.cookies.get(self.cookie_name(request))):
            return True
        if not self.loopback:
            raise web.HTTPForbidden(text="this console is served beyond loopback: open it with "
                                         "its token (the URL printed at start)\n")
        return False

    @staticmethod
    def cookie_name(request: web.Request) -> str:
        """Cookies ignore ports: one name per port, so two servers on a host keep apart."""
        return f"{COOKIE}_{request.url.port or 0}"

    @staticmethod
    def _check_origin(request: web.Request) -> None:
        """A websocket from a page of another origin (its ``Origin`` names another host:port
        than the request's ``Host``) is refused; a client that sends no ``Origin`` is no page."""
        origin = request.headers.get("Origin")
        if origin is None:
            return
        try:
            url = yarl.URL(origin)
            here = yarl.URL(f"{url.scheme or 'http'}://{request.host}")
            same = (url.host is not None and url.host.lower() == (here.host or "").lower()
                    and url.port == here.port)
        except ValueError:
            same = False
        if not same:
            raise web.HTTPForbidden(text="a page of another origin may not open a console\n")

    def _sign(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def _mint(self, steer: bool) -> str:
        """A signed ticket: nothing is stored until it is taken."""
        expires = time.monotonic() + TICKET_TTL_S
        body = f"{int(steer)}.{expires:.3f}.{secrets.token_urlsafe(16)}".encode()
        sig = base64.urlsafe_b64encode(self._sign(body)).rstrip(b"=")
        return (base64.urlsafe_b64encode(body).rstrip(b"=") + b"~" + sig).decode()

    def _take(self, ticket: str) -> Ticket | None:
        """The ticket's rights, once; None when forged, expired or used."""
        now = time.monotonic()
        for nonce in [n for n, exp in self._used.items() if exp < now]:
            del self._used[nonce]
        try:
            b64body, b64sig = ticket.split("~", 1)
            body = base64.urlsafe_b64decode(b64body + "=" * (-len(b64body) % 4))
            sig = base64.urlsafe_b64decode(b64sig + "=" * (-len(b64sig) % 4))
        except (ValueError, TypeError):
            return None
        if not hmac.compare_digest(sig, self._sign(body)):
            return None
        try:
            steer, expires_s, nonce = body.decode().split(".", 2)
            expires = float(expires_s)
        except ValueError:
            return None
        if expires < now or nonce in self._used:
            return None
        self._used[nonce] = expires
        return Ticket(steer == "1", expires, nonce)

    def _check_room(self, steer: bool) -> None:
        """Only live consoles count; read-only tabs leave `STEER_RESERVED` for the token's."""
        live = len(self._sockets)
        if live >= MAX_CONSOLES:
            raise web.HTTPServiceUnavailable(text=f"{MAX_CONSOLES} consoles open already\n")
        if not steer and self.token is not None:
            readonly = sum(1 for s in self._sockets.values() if not s)
            if readonly >= MAX_CONSOLES - STEER_RESERVED:
                raise web.HTTPServiceUnavailable(
                    text=f"{readonly} read-only consoles open already (the rest are kept for "
                         "tabs opened with the token)\n")

    # --- routes -----------------------------------------------------------------------------

    async def _make_app(self) -> web.Application:
        app = web.Application()
        aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(self.templates_path))
        app.add_routes([
            web.get("/", self.handle_index, name="index"),
            web.get("/ws/{ticket}", self.handle_websocket, name="websocket"),
            web.static("/static", self.statics_path, name="static"),
        ])
        app.on_shutdown.append(self.on_shutdown)
        return app

    async def handle_index(self, request: web.Request) -> web.Response:  # type: ignore[override]
        """textual-serve's page, its websocket URL carrying a fresh ticket."""
        self._check_host(request)
        if request.headers.get("Sec-Fetch-Site") == "cross-site":
            raise web.HTTPForbidden(text="a console is not opened from another site: paste "
                                         "its URL into the address bar\n")
        steer = self.may_steer(request)
        if "token" in request.query:
            # The token leaves the URL (history, screen shares): a cookie carries it on.
            redirect = web.Response(status=303, headers={"Location": "/"})
            redirect.set_cookie(self.cookie_name(request), request.query["token"], path="/",
                                httponly=True, samesite="Strict")
            self._secure_headers(redirect, request)
            return redirect
        ticket = self._mint(steer)
        scheme = "wss" if request.secure else "ws"
        context = {
            "font_size": clamp_cells(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": f"{scheme}://{request.host}/ws/{ticket}",
            "config": {"static": {"url": "/static/"}},
            "application": {"name": self.title},
        }
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        response.text = OUTSIDE_FONT.sub("", response.text or "")
        self._secure_headers(response, request)
        if not steer and self.cookie_name(request) in request.cookies:
            response.del_cookie(self.cookie_name(request), path="/")   # stale: an earlier start
        return response

    @staticmethod
    def _secure_headers(response: web.StreamResponse, request: web.Request) -> None:
        response.headers["Cache-Control"] = "no-store"
        response.headers["Referrer-Policy"] = "no-referrer"   # the token stays in this tab
        response.headers["X-Frame-Options"] = "DENY"          # no other site frames a console
        response.headers["X-Content-Type-Options"] = "nosniff"
        # textual-serve's page: its own script and styles, inline ones (its Start button's
        # onClick), its background image, and the websocket back to this server.
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; "
            f"connect-src 'self' ws://{request.host} wss://{request.host}; "
            "script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; font-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's websocket handler, for the command the ticket's rights name."""
        self._check_host(request)
        self._check_origin(request)
        ticket = self._take(request.match_info["ticket"])
        if ticket is None:
            raise web.HTTPForbidden(text="no such console ticket: reload the page\n")
        self._check_room(ticket.steer)
        websocket = web.WebSocketResponse(heartbeat=HEARTBEAT_S)
        width = clamp_cells(request.query.get("width", "80"), 80)
        height = clamp_cells(request.query.get("height", "24"), 24)
        self._sockets[websocket] = ticket.steer
        app_service: ConsoleProcess | None = None

        async def close() -> None:
            await websocket.close()

        try:
            await websocket.prepare(request)
            app_service = ConsoleProcess(self.argv_for(ticket.steer),
                                         write_bytes=websocket.send_bytes,
                                         write_str=websocket.send_str, close=close,
                                         download_manager=self.download_manager)
            await app_service.start(width, height)
            await self._process_messages(websocket, app_service)
        except asyncio.CancelledError:
            await websocket.close()
            raise
        except Exception:
            log.exception("console session failed")
        finally:
            self._sockets.pop(websocket, None)
            if app_service is not None:
                await app_service.stop()
        return websocket

    async def on_shutdown(self, app: web.Application) -> None:
        """Close every tab's websocket: its console is told to quit and is waited for."""
        for ws in list(self._sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")

    # --- running ----------------------------------------------------------------------------

    def serve_until_stopped(self, on_ready: Callable[[str, int], None]) -> None:
        """Serve until SIGINT or SIGTERM; ``on_ready(host, port)`` once bound (the port
        actually bound when ``port`` was 0)."""
        asyncio.run(self._serve(on_ready))

    async def _serve(self, on_ready: Callable[[str, int], None]) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(await self._make_app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            bound = runner.addresses[0]
            on_ready(self.host, int(bound[1]))
            await stop.wait()
        finally:
            await runner.cleanup()
