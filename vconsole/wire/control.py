"""The control protocol: request/reply over ZeroMQ to read and change the engine's config.

The engine binds a ROUTER (served by `vconsole.engine.process.control_server`); clients connect a
DEALER (`vconsole.wire.control_client.ControlClient`) or a REQ. Either way the ROUTER sees ``[identity, b"", request]`` and
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

from collections.abc import Sequence
from typing import Any

import msgpack

from vconsole.shared.config import ConfigUpdate, describe_config

OPS = ("get_config", "set_config", "profile_start", "profile_status", "profile_cancel",
       "get_trace")
PROFILE_MAX_STEPS = 200   # a profile's trace is kept in memory until its last step


class ControlError(RuntimeError):
    """A malformed request, or an engine reply that says the request failed."""


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
