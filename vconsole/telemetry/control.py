"""The control protocol: request/reply over ZeroMQ to read and change the engine's config.

The engine binds a ROUTER (served by `vconsole.engine.process.control_server`); clients connect a
DEALER (`ControlClient`) or a REQ. Either way the ROUTER sees ``[identity, b"", request]`` and
answers ``[identity, b"", reply]`` (`split_routed` / `routed_reply` do the framing). Bodies are
msgpack maps:

- request ``{"op": "get_config", "id": n, "key": k}`` or
  ``{"op": "set_config", "values": {...}, "id": n, "key": k}`` (``id`` optional; echoed in the
  reply so a DEALER can drop a late reply to an older request. ``key`` optional: the engine's
  control key, see below).
- reply, always with every key: ``ok``, ``error`` (None unless the request itself was bad),
  ``applied`` {key: new value}, ``rejected`` {key: reason}, ``restart_required`` [keys],
  ``version``, ``values`` (the effective config after the request), ``schema``
  (`vconsole.shared.config.describe_config()` rows), ``id``.

Invariant: `decode_request` either returns a well-formed request or raises `ControlError` whose
message becomes the ``error`` of an ``ok: false`` reply; the engine never answers a malformed
request with silence.

Authentication: the control key (`vconsole.security.control_key`). ``get_config`` is open;
``set_config`` without the engine's key is answered ``ok: false`` with an ``error`` starting
``not authorised:`` (`ControlClient.set_config` raises `NotAuthorised`) and changes nothing.
An engine started with CURVE keys (`vconsole.security.curve`) answers only CURVE clients whose
key pair it authorises: `ControlClient` takes them as ``curve``. The control key is still needed
for ``set_config`` then: CURVE says who may connect at all (submit requests, read telemetry), the
key says who may change the engine.

Profiling on demand (`vconsole.engine.process.profile_book`): ``{"op": "profile_start", "steps": n}``
(the control key required, like ``set_config``; ``1 <= n <= PROFILE_MAX_STEPS``) arms
``torch.profiler`` over the engine's next ``n`` steps and answers at once (with ``"nsys": true``:
Nsight Systems' capture range, ``cudaProfilerStart/Stop``, around them instead);
``{"op": "profile_status", "profile": pid}`` (open, like ``get_config``) and
``{"op": "profile_cancel", "profile": pid}`` (key required) follow it. Their replies carry every
field above plus ``profile``: the profile's status, with its ``result`` once it is done
(`ControlClient.profile_start` / `profile_status` / `profile_cancel`).

The request trace (`vconsole.telemetry.request_trace`): ``{"op": "get_trace", "window_s": s}``
(open, like ``get_config``: the trace holds no text; ``window_s`` optional, default the whole
window the engine keeps, 300 s) is answered with every field above plus ``trace``: the last
``window_s`` seconds as the trace's JSON lines (`ControlClient.get_trace`; parse it with
`vconsole.telemetry.request_trace.parse_lines`). The engine serializes it on its control
thread, never between two steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from vconsole.security.control_key import NOT_AUTHORISED
from vconsole.security.curve import ClientCurve
from vconsole.security.endpoints import DEFAULT_CONTROL
from vconsole.shared.config import ConfigUpdate, describe_config

OPS = ("get_config", "set_config", "profile_start", "profile_status", "profile_cancel",
       "get_trace")
PROFILE_MAX_STEPS = 200   # a profile's trace is kept in memory until its last step


class ControlError(RuntimeError):
    """A malformed request, or an engine reply that says the request failed."""


class NotAuthorised(ControlError):
    """The engine refused a set_config: this client does not hold its control key."""


# --- bodies -----------------------------------------------------------------------------------

def encode_request(op: str, values: dict[str, Any] | None = None, *,
                   request_id: int | None = None, key: str | None = None,
                   fields: dict[str, Any] | None = None) -> bytes:
    """``fields``: the op's own fields (``steps``, ``profile``)."""
    req: dict[str, Any] = {"op": op, **(fields or {})}
    if values is not None:
        req["values"] = values
    if request_id is not None:
        req["id"] = request_id
    if key is not None:
        req["key"] = key
    return msgpack.packb(req, use_bin_type=True)


def _unpack_map(data: bytes | memoryview, what: str) -> dict[str, Any]:
    """A msgpack map, or ControlError saying why ``what`` (request / reply) is not one."""
    try:
        out = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise ControlError(f"{what} is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(out, dict):
        raise ControlError(f"{what} must be a map, got {type(out).__name__}")
    return out


def decode_request(data: bytes | memoryview) -> dict[str, Any]:
    """Parse and validate a request; raises ControlError with a reason."""
    req = _unpack_map(data, "request")
    op = req.get("op")
    if op not in OPS:
        raise ControlError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if op == "set_config":
        values = req.get("values")
        if not isinstance(values, dict) or not values:
            raise ControlError("set_config needs 'values': a non-empty map of key -> value")
        if not all(isinstance(k, str) for k in values):
            raise ControlError("set_config 'values' keys must be strings")
    if op == "profile_start":
        steps = req.get("steps")
        if (not isinstance(steps, int) or isinstance(steps, bool)
                or not 1 <= steps <= PROFILE_MAX_STEPS):
            raise ControlError(f"profile_start needs 'steps': an integer from 1 to "
                               f"{PROFILE_MAX_STEPS}, got {steps!r}")
        if not isinstance(req.get("nsys", False), bool):
            raise ControlError(f"profile_start 'nsys' must be true or false, got "
                               f"{req['nsys']!r}")
    if op in ("profile_status", "profile_cancel") and not isinstance(req.get("profile"), str):
        raise ControlError(f"{op} needs 'profile': the id profile_start answered")
    if op == "get_trace" and req.get("window_s") is not None:
        window = req["window_s"]
        if (not isinstance(window, int | float) or isinstance(window, bool)
                or not window > 0 or window != window):
            raise ControlError(f"get_trace 'window_s' must be a number of seconds > 0, got "
                               f"{window!r}")
    rid = req.get("id")
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise ControlError(f"'id' must be an integer, got {rid!r}")
    if "key" in req and not isinstance(req["key"], str):
        raise ControlError("'key' must be a string (the engine's control key)")
    return req


def make_reply(*, ok: bool, version: int = 0, values: dict[str, Any] | None = None,
               schema: list[dict[str, Any]] | None = None, applied: dict[str, Any] | None = None,
               rejected: dict[str, str] | None = None, restart_required: Sequence[str] = (),
               error: str | None = None, request_id: int | None = None) -> dict[str, Any]:
    """A reply with every key present, so clients never need ``.get``."""
    return {"ok": ok, "error": error, "applied": dict(applied or {}),
            "rejected": dict(rejected or {}), "restart_required": list(restart_required),
            "version": version, "values": dict(values or {}), "schema": list(schema or []),
            "id": request_id}


def error_reply(error: str, request_id: int | None = None) -> dict[str, Any]:
    return make_reply(ok=False, error=error, request_id=request_id)


def config_reply(version: int, values: dict[str, Any], update: ConfigUpdate | None = None,
                 request_id: int | None = None) -> dict[str, Any]:
    """Reply for get_config (``update`` None) or set_config; ``version``/``values`` are the
    config after the update."""
    if update is None:
        return make_reply(ok=True, version=version, values=values, schema=describe_config(),
                          request_id=request_id)
    return make_reply(ok=update.ok, version=version, values=values, schema=describe_config(),
                      applied=update.applied, rejected=update.rejected,
                      restart_required=update.restart_required, request_id=request_id)


def profile_reply(status: dict[str, Any], request_id: int | None = None) -> dict[str, Any]:
    """Reply for the profile ops: every common field, plus ``profile`` (the status)."""
    return {**make_reply(ok=True, request_id=request_id), "profile": status}


def trace_reply(lines: str, request_id: int | None = None) -> dict[str, Any]:
    """Reply for get_trace: every common field, plus ``trace`` (JSON lines)."""
    return {**make_reply(ok=True, request_id=request_id), "trace": lines}


def encode_reply(reply: dict[str, Any]) -> bytes:
    return msgpack.packb(reply, use_bin_type=True)


def decode_reply(data: bytes | memoryview) -> dict[str, Any]:
    reply = _unpack_map(data, "reply")
    if "ok" not in reply:
        raise ControlError("reply must be a map with an 'ok' field")
    return reply


# --- ROUTER framing (engine side) ---------------------------------------------------------------

def split_routed(frames: Sequence[bytes]) -> tuple[list[bytes], bytes]:
    """``[identity..., b"", body]`` -> (route, body). The route is echoed back unchanged."""
    if len(frames) < 2:
        raise ControlError("routed request has no body")
    try:
        delim = list(frames).index(b"")
    except ValueError:
        return list(frames[:-1]), frames[-1]
    if delim + 1 >= len(frames):
        raise ControlError("routed request has no body")
    return list(frames[:delim]), frames[delim + 1]


def routed_reply(route: Sequence[bytes], reply: dict[str, Any]) -> list[bytes]:
    return [*route, b"", encode_reply(reply)]


def handle_frames(frames: Sequence[bytes], handler: Any) -> list[bytes]:
    """One ROUTER turn: ``handler(request) -> reply dict`` runs on a valid request; a malformed
    one is answered ``ok: false`` without calling it. Returns the frames to send back."""
    route, body = split_routed(frames)
    try:
        req = decode_request(body)
    except ControlError as e:
        return routed_reply(route, error_reply(str(e)))
    reply = handler(req)
    reply.setdefault("id", req.get("id"))
    return routed_reply(route, reply)


# --- client -----------------------------------------------------------------------------------

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
