"""A tiny HTTP server on 127.0.0.1 for the stand-ins of other engines' servers: GET routes only,
each answered by a function of the path (status, content type, body)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[str], tuple[int, str, bytes]]


class StandIn:
    """``serve(port)`` (0: a free one) returns the base URL; ``close`` stops it (a stand-in that
    can be stopped and started again on the same port: a killed and restarted server)."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    def serve(self, port: int = 0) -> str:
        route = self.route

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                status, ctype, body = route(self.path.split("?")[0])
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
