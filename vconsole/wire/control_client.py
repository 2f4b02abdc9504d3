"""ControlClient: the blocking client of the control protocol (`vconsole.wire.control`).

One DEALER per client, one request at a time. The CLI (`vconsole set`, `profile`, `trace`), the
tools, the recorder, the console's control link and the data-parallel front end (which forwards
a client's request to every rank) all talk to an engine's control socket through it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from vconsole.security.control_key import NOT_AUTHORISED
from vconsole.security.curve import ClientCurve
from vconsole.security.endpoints import DEFAULT_CONTROL
from vconsole.wire.control import ControlError, decode_reply, encode_request


class NotAuthorised(ControlError):
    """The engine refused a set_config: this client does not hold its control key."""


class ControlClient:
    """Blocking client. After a timeout the socket is dropped and a fresh one made on the next
    call, so a late reply can never be taken for the answer to a later request. ``key`` (the
    engine's control key, `vconsole.security.control_key.load_control_key`) is sent with every
    request; without it the client can read but not change the config. ``curve``: this client's
    CURVE keys, for an engine started with them."""

    def __init__(self, endpoint: str = DEFAULT_CONTROL, timeout_s: float = 5.0, *,
                 ctx: zmq.Context | None = None, curve: ClientCurve | None = None,
                 key: str | None = None) -> None:
        self.curve = curve
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.key = key
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def request(self, op: str, values: dict[str, Any] | None = None, *,
                fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one request and wait for its reply; raises TimeoutError or ControlError."""
        rid = next(self._ids)
        sock = self._socket()
        sock.send_multipart([b"", encode_request(op, values, request_id=rid,
                                                   key=self.key, fields=fields)])
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                continue
            frames = sock.recv_multipart()
            reply = decode_reply(frames[-1])
            if reply.get("id") in (rid, None):
                return reply
        self.close()
        hint = ("is the engine running, and does it authorise this client's CURVE key?"
                if self.curve is not None else "is the engine running? One started with CURVE "
                "keys answers only clients holding them")
        raise TimeoutError(f"no reply from the engine's control socket at {self.endpoint} "
                           f"within {self.timeout_s:g} s ({hint})")

    def get_config(self) -> dict[str, Any]:
        """The reply: ``values``, ``version``, ``schema``. Raises ControlError if not ok."""
        reply = self.request("get_config")
        if not reply.get("ok"):
            raise ControlError(reply.get("error") or "get_config failed")
        return reply

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        """The reply; a refused change is ``ok: false`` with ``rejected``/``restart_required``
        (not an exception). Raises NotAuthorised without the engine's key, ControlError for
        another protocol error."""
        reply = self.request("set_config", values)
        if not reply.get("ok") and reply.get("error"):
            if str(reply["error"]).startswith(NOT_AUTHORISED + ":"):
                raise NotAuthorised(reply["error"])
            raise ControlError(reply["error"])
        return reply

    def _profile_op(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        reply = self.request(op, fields=fields)
        if not reply.get("ok"):
            error = str(reply.get("error") or f"{op} failed")
            if error.startswith(NOT_AUTHORISED + ":"):
                raise NotAuthorised(error)
            raise ControlError(error)
        return reply["profile"]

    def profile_start(self, steps: int, *, nsys: bool = False) -> dict[str, Any]:
        """Profile the engine's next ``steps`` steps; the new profile's status (its ``id``).
        ``nsys``: open Nsight Systems' capture range around them instead (``cudaProfilerStart/
        Stop``), no torch.profiler. Raises NotAuthorised without the key, ControlError when
        refused (one is running; nsys on an engine without CUDA)."""
        return self._profile_op("profile_start", {"steps": steps, **({"nsys": True} if nsys
                                                                      else {})})

    def profile_status(self, profile_id: str) -> dict[str, Any]:
        """``state`` (running / done / cancelled / failed), ``steps_done`` of ``steps``, and
        ``result`` once done. Raises ControlError for an unknown id."""
        return self._profile_op("profile_status", {"profile": profile_id})

    def profile_cancel(self, profile_id: str) -> dict[str, Any]:
        """Stop a running profile (no result); its status. Raises NotAuthorised without the key."""
        return self._profile_op("profile_cancel", {"profile": profile_id})

    def get_trace(self, window_s: float | None = None) -> str:
        """The engine's request trace of the last ``window_s`` seconds (None: all it keeps)
        as JSON lines (`vconsole.telemetry.request_trace.parse_lines` reads them). Raises
        ControlError when the engine refuses (or does not know the op: an older engine)."""
        reply = self.request("get_trace",
                             fields=None if window_s is None else {"window_s": window_s})
        if not reply.get("ok"):
            raise ControlError(str(reply.get("error") or "get_trace failed"))
        trace = reply.get("trace")
        if not isinstance(trace, str):
            raise ControlError("the engine's get_trace reply holds no trace")
        return trace

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
