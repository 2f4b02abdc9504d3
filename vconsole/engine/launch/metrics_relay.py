"""MetricsRelay: a supervised engine's ``/metrics`` keeps answering while the engine restarts.

Prometheus scrapes the port given with ``--metrics-port``; if the engine process served it, a
crash would turn every scrape into a connection error until a new process had loaded its model
— exactly when the figures matter. So under the supervisor the public port is the
supervisor's: it runs this relay, and each engine process serves its own ``/metrics`` on a
private loopback port (named in its ready file). A scrape is relayed to the current engine;
when none answers (dead, restarting, still loading) the relay answers with the last good scrape
with ``vconsole:engine_up`` set to 0 and ``vconsole:engine_restarts_total`` set to the
supervisor's count (`mark_down`) — the last values, as the issue of a dead exporter is usually
solved with a ``up`` series, not with silence.

Invariants: the relay never blocks the supervisor (its own threads); one scrape costs one
loopback HTTP request to the engine, bounded by `UPSTREAM_TIMEOUT_S`; nothing but ``GET
/metrics`` is answered (404).
"""

from __future__ import annotations

import re
import socket
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vconsole.engine.publish.prometheus import metrics_url

UPSTREAM_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_UP = re.compile(r"^(vconsole:engine_up(?:\{[^}]*\})?) \S+$", re.M)
_RESTARTS = re.compile(r"^(vconsole:engine_restarts_total(?:\{[^}]*\})?) \S+$", re.M)


def mark_down(text: str, restart_count: int) -> str:
    """The last good scrape as it reads while no engine answers: ``engine_up`` 0 and the
    supervisor's restart count (series added when the scrape had none)."""
    text = _RESTARTS.sub(lambda m: f"{m.group(1)} {float(restart_count)}", text)
    if _UP.search(text):
        return _UP.sub(lambda m: f"{m.group(1)} 0.0", text)
    return (text + "# HELP vconsole:engine_up 1 while an engine process serves, 0 while it "
            "restarts.\n# TYPE vconsole:engine_up gauge\nvconsole:engine_up 0.0\n")


class MetricsRelay:
    """Serves ``/metrics`` on ``host:port`` (0: any free port; `port` / `url` after `start`).
    ``upstream()`` is the engine's own metrics URL, or None while no engine serves;
    ``restart_count()`` the supervisor's count."""

    def __init__(self, host: str, port: int, *, upstream: Callable[[], str | None],
                 restart_count: Callable[[], int]) -> None:
        self.host = host
        self.port = port
        self._upstream = upstream
        self._restart_count = restart_count
        self._last: str | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return metrics_url(self.host, self.port)

    def scrape(self) -> str:
        """What a scrape answers now (see the module docstring)."""
        url = self._upstream()
        if url is not None:
            try:
                with urllib.request.urlopen(url, timeout=UPSTREAM_TIMEOUT_S) as resp:
                    text = resp.read().decode()
                with self._lock:
                    self._last = text
                return text
            except (OSError, ValueError):
                pass            # the engine just died, or is not serving yet
        with self._lock:
            last = self._last
        return mark_down(last or "", self._restart_count())

    def start(self) -> MetricsRelay:
        """Bind and serve; raises OSError here (e.g. the port is in use)."""
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = relay.scrape().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server = type("Server", (ThreadingHTTPServer,),
                      {"address_family": family, "daemon_threads": True})
        self._server = server((self.host, self.port), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="metrics-relay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = None
