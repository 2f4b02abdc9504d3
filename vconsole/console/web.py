"""The console in a browser: `vconsole attach --web` serves `vconsole attach` through
textual-serve, one console process per browser tab.

Who may steer. A tab runs the console exactly as `vconsole attach` with the same endpoint flags
would, as this process's user: it holds the control key when this side does, and is read-only
when it does not. A tab whose page was opened without the token printed at start runs with
``--readonly`` on top. On a loopback address (the default) anyone on the machine may open a
read-only tab; beyond loopback every page needs the token, and serving there without one
(``token=None``) is refused before anything binds (`check_web_host`). A wrong token is refused,
never downgraded to read-only.

How a tab's rights reach its process. textual-serve starts its command when the page's
websocket connects, and the websocket does not carry the page's URL. So the page decides: it
checks the token (`hmac.compare_digest`), mints a ticket naming the tab's rights (single use,
unguessable, `TICKET_TTL_S`), and puts it in the page's websocket URL (``/ws/TICKET``); the
websocket takes the ticket and starts the console for those rights. A page of another site can
read no ticket (same-origin policy), and on a loopback address a request whose ``Host`` is not
a loopback name is refused, so a DNS-rebound name cannot either.

The token is printed once, at start, by the caller; it never reaches a log (aiohttp's access log
is off) nor a console's command line.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp_jinja2
import jinja2
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
HEARTBEAT_S = 15.0


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
        self._tickets: dict[str, Ticket] = {}
        self._sockets: set[web.WebSocketResponse] = set()

    def command_for(self, steer: bool) -> str:
        """The console's command line for a tab: read-only unless its page had the token."""
        argv = self.base_command
        if not steer and "--readonly" not in argv:
            argv = [*argv, "--readonly"]
        return shlex.join(argv)

    # --- access -----------------------------------------------------------------------------

    def _check_host(self, request: web.Request) -> None:
        try:
            name = request.url.host or ""
        except ValueError:
            raise web.HTTPBadRequest(text="bad Host header\n") from None
        if self.loopback and not loopback_host(name):
            raise web.HTTPForbidden(text=f"this console answers only to loopback names, not "
                                         f"{request.host!r}\n")

    def may_steer(self, request: web.Request) -> bool:
        """Whether the page may steer: True with the right token, False without one on a
        loopback address; refused (403) with a wrong one, or without one beyond loopback."""
        given = request.query.get("token")
        if given is not None:
            if self.token is None or not hmac.compare_digest(given.encode(),
                                                             self.token.encode()):
                raise web.HTTPForbidden(text="wrong token: open the URL `vconsole attach "
                                             "--web` printed when it started\n")
            return True
        if not self.loopback:
            raise web.HTTPForbidden(text="this console is served beyond loopback: open it with "
                                         "its token (the URL printed at start)\n")
        return False

    def _mint(self, steer: bool) -> str:
        now = time.monotonic()
        for key in [k for k, t in self._tickets.items() if t.expires < now]:
            del self._tickets[key]
        if len(self._tickets) + len(self._sockets) >= 2 * MAX_CONSOLES:
            raise web.HTTPServiceUnavailable(text="too many consoles open\n")
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = Ticket(steer, now + TICKET_TTL_S)
        return ticket

    def _take(self, ticket: str) -> Ticket | None:
        t = self._tickets.pop(ticket, None)
        return t if t is not None and t.expires >= time.monotonic() else None

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
        steer = self.may_steer(request)
        ticket = self._mint(steer)
        scheme = "wss" if request.secure else "ws"
        context = {
            "font_size": to_int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": f"{scheme}://{request.host}/ws/{ticket}",
            "config": {"static": {"url": "/static/"}},
            "application": {"name": self.title},
        }
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        response.headers["Cache-Control"] = "no-store"
        response.headers["Referrer-Policy"] = "no-referrer"   # the token stays in this tab
        response.headers["X-Frame-Options"] = "DENY"          # no other site frames a console
        response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        return response

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's websocket handler, for the command the ticket's rights name."""
        self._check_host(request)
        ticket = self._take(request.match_info["ticket"])
        if ticket is None:
            raise web.HTTPForbidden(text="no such console ticket: reload the page\n")
        if len(self._sockets) >= MAX_CONSOLES:
            raise web.HTTPServiceUnavailable(text=f"{MAX_CONSOLES} consoles open already\n")
        websocket = web.WebSocketResponse(heartbeat=HEARTBEAT_S)
        width = to_int(request.query.get("width", "80"), 80)
        height = to_int(request.query.get("height", "24"), 24)
        self._sockets.add(websocket)
        app_service: AppService | None = None

        async def close() -> None:
            await websocket.close()

        try:
            await websocket.prepare(request)
            app_service = AppService(self.command_for(ticket.steer),
                                     write_bytes=websocket.send_bytes,
                                     write_str=websocket.send_str, close=close,
                                     download_manager=self.download_manager)
            await app_service.start(width, height)
            await self._process_messages(websocket, app_service)
        except asyncio.CancelledError:
            await websocket.close()
        except Exception:
            log.exception("console session failed")
        finally:
            self._sockets.discard(websocket)
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
