"""The request wire protocol between clients and the engine process (one schema, both sides).

A message is one ZeroMQ multipart message. Frame 0 is a msgpack map, the *header*; frames 1..
are raw array buffers that the header refers to with a msgpack extension value (type
`EXT_ARRAY`: frame index + numpy dtype string). Arrays therefore never become msgpack lists on
the way out (`encode` hands numpy arrays to ``send_multipart(copy=False)``) nor Python lists on
the way in (`decode` wraps the received frame with ``np.frombuffer``). Arrays of at most
`INLINE_MAX` elements travel inline as plain lists: one decode token per step is cheaper inline
than as its own frame.

Every header carries ``v`` (`PROTOCOL_VERSION`) and ``type``:

client -> engine (input socket)
    ``hello``  {}                                       answered by ``ready`` on the output socket
    ``add``    {request_id, prompt | prompt_token_ids, sampling{...}, priority}
    ``abort``  {request_ids}
    ``start_wave`` {wave}                               data parallel: another rank started
                                                        ``wave`` (from the front end)
    ``regroup`` {generation}                            data parallel: form process group
                                                        ``generation`` (from the front end)
engine -> client (output socket)
    ``ready``   {engine_id, config_version, vocab_size, max_model_len, heartbeat_interval_s}
    ``heartbeat`` {engine_id}                           every heartbeat_interval_s to each client
                                                        that said hello: its liveness signal
    ``outputs`` {outputs: [{request_id, new_token_ids, finished, finish_reason, text,
                 num_prompt_tokens, num_cached_tokens, num_output_tokens, num_preemptions,
                 error, logprobs?, prompt_logprobs?}]}    ``prompt_logprobs``: [token logprobs,
                                                        ranks, top ids, top logprobs], once
    ``error``   {reason, request_id, in_flight}         a message the engine could not accept
    ``wave``    {event, wave}                           data parallel: a wave ``start``-ed here
                                                        or ``complete``-d; to every client that
                                                        said hello

``start_wave`` and ``regroup`` are for data-parallel ranks only (``data_parallel_size > 1``); a
lone engine answers them with an ``error`` and goes on serving.

Invariants: `decode` and the ``parse_*`` functions never raise anything but `ProtocolError`, so a
malformed frame costs the engine one reply, never its input thread. A `ProtocolError` carries the
request id whenever the message named one in a readable header, even if the rest of the message
(frame count, array references, version) is bad, so the engine can answer that request with its
final output. ``v`` must be the integer 1 (not ``true``, not ``1.0``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from vconsole.wire.outputs import PromptLogprobs, RequestOutput
from vconsole.wire.sampling import SamplingParams, StructuredSpec

PROTOCOL_VERSION = 1
INLINE_MAX = 16
EXT_ARRAY = 1
MAX_FRAMES = 8
MAX_REQUEST_ID_LEN = 256
SHUTTING_DOWN = "engine is shutting down"   # why an ``add`` or a control request is refused
TOKEN_DTYPE = np.dtype("<i4")

HELLO, READY, ADD, ABORT, OUTPUTS, ERROR, HEARTBEAT = (
    "hello", "ready", "add", "abort", "outputs", "error", "heartbeat")
START_WAVE, REGROUP, WAVE = "start_wave", "regroup", "wave"   # data parallel (ranks only)
CLIENT_TYPES = frozenset({HELLO, ADD, ABORT, START_WAVE, REGROUP})
ENGINE_TYPES = frozenset({READY, OUTPUTS, ERROR, HEARTBEAT, WAVE})
WAVE_EVENTS = ("start", "complete")

SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
                 "ignore_eos", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logprobs", "prompt_logprobs", "structured")

Frames = list[Any]  # bytes / numpy arrays on send; bytes / memoryviews on receive


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1   # a request's priority (lower runs first)


class ProtocolError(ValueError):
    """A message the receiver cannot accept. ``request_id`` is set when the message named one,
    so the engine can answer that request instead of the client as a whole."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


# --- framing --------------------------------------------------------------------------------

def encode(header: dict[str, Any]) -> Frames:
    """Header -> frames. numpy arrays anywhere in the header go out as their own frames."""
    buffers: list[np.ndarray] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = obj if obj.ndim == 1 and obj.flags.c_contiguous else \
                np.ascontiguousarray(obj.reshape(-1))
            if arr.size <= INLINE_MAX:
                return arr.tolist()
            buffers.append(arr)
            return msgpack.ExtType(EXT_ARRAY, struct.pack("<I", len(buffers)) +
                                   arr.dtype.str.encode())
        if isinstance(obj, np.integer | np.floating | np.bool_):
            return obj.item()
        raise TypeError(f"cannot encode {type(obj).__name__}")

    head = {"v": PROTOCOL_VERSION, **header}
    return [msgpack.packb(head, default=default, use_bin_type=True), *buffers]


def decode(frames: Sequence[Any]) -> dict[str, Any]:
    """Frames -> header, with array references resolved to zero-copy numpy views.

    Checks the version and that ``type`` is a string; the per-type ``parse_*`` functions check
    the rest."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames ({len(frames)} > {MAX_FRAMES})",
                            _salvage_request_id(frames[0]))

    def ext_hook(code: int, data: bytes) -> Any:
        if code != EXT_ARRAY or len(data) < 5:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        (index,) = struct.unpack_from("<I", data)
        try:
            dtype = np.dtype(data[4:].decode("ascii"))
        except (TypeError, ValueError, UnicodeDecodeError):
            raise ProtocolError(f"bad array dtype {data[4:]!r}") from None
        if dtype.kind not in "iu":
            raise ProtocolError(f"arrays must be integer, got dtype {dtype.str}")
        if not 1 <= index < len(frames):
            raise ProtocolError(f"array refers to frame {index}; message has {len(frames)}")
        buf = memoryview(frames[index])
        if buf.nbytes % dtype.itemsize:
            raise ProtocolError(f"frame {index}: {buf.nbytes} bytes is not a whole number of "
                                f"{dtype.str} items")
        return np.frombuffer(buf, dtype=dtype)

    try:
        header = msgpack.unpackb(frames[0], ext_hook=ext_hook, raw=False, strict_map_key=True)
    except ProtocolError as e:
        raise ProtocolError(e.reason, _salvage_request_id(frames[0])) from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    rid = request_id_of(header)
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} not supported (this side speaks "
                            f"the integer {PROTOCOL_VERSION})", rid)
    if not isinstance(header.get("type"), str):
        raise ProtocolError("header has no 'type'", rid)
    return header


def request_id_of(header: dict[Any, Any]) -> str | None:
    """The header's ``request_id`` if it is a valid one (a string of 1..256 characters)."""
    rid = header.get("request_id")
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN else None


def _salvage_request_id(frame: Any) -> str | None:
    """The request id of a header whose message is otherwise unusable (too many frames, a bad
    array reference), so its request can still get a final output; None if there is none."""
    try:
        header = msgpack.unpackb(frame, ext_hook=lambda code, data: None, raw=False,
                                 strict_map_key=True)
    except Exception:  # garbage: nothing to salvage
        return None
    return request_id_of(header) if isinstance(header, dict) else None


# --- client -> engine ----------------------------------------------------------------------

def sampling_to_wire(sampling: SamplingParams | dict[str, Any] | None) -> dict[str, Any]:
    if sampling is None:
        return {}
    if isinstance(sampling, SamplingParams):
        return {k: _wire_value(k, v)
                for k in SAMPLING_KEYS if (v := getattr(sampling, k)) is not None}
    out = dict(sampling)
    if isinstance(out.get("structured"), StructuredSpec):
        out["structured"] = _wire_value("structured", out["structured"])
    return out


def _wire_value(key: str, value: Any) -> Any:
    """A sampling field as msgpack carries it: lists, and the structured-output spec as the map
    ``{"kind": ..., "value": ...}``."""
    if key == "stop_token_ids":
        return list(value)
    if key == "structured" and isinstance(value, StructuredSpec):
        return {"kind": value.kind, "value": value.value}
    return value


def encode_hello() -> Frames:
    return encode({"type": HELLO})


def check_request_id(request_id: Any) -> str:
    """The sender's side of `parse_add`'s rule; raises ValueError with the reason. An id the
    engine would reject cannot be named in its reply, so it must never leave the client."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters, got "
                         f"{len(request_id)}")
    return request_id


def encode_add(request_id: str, *, prompt: str | None = None,
               prompt_token_ids: Sequence[int] | np.ndarray | None = None,
               sampling: SamplingParams | dict[str, Any] | None = None,
               priority: int = 0) -> Frames:
    check_request_id(request_id)
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt and prompt_token_ids")
    header: dict[str, Any] = {"type": ADD, "request_id": request_id, "priority": priority,
                              "sampling": sampling_to_wire(sampling)}
    if prompt is not None:
        header["prompt"] = prompt
    else:
        ids = np.asarray(prompt_token_ids)
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= 2**31):
            raise ValueError("prompt_token_ids must be integers in [0, 2**31)")
        header["prompt_token_ids"] = ids.astype(TOKEN_DTYPE, copy=False)
    return encode(header)


def encode_abort(request_ids: Iterable[str]) -> Frames:
    return encode({"type": ABORT, "request_ids": list(request_ids)})


@dataclass(frozen=True)
class AddMessage:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    priority: int


def _int(value: Any, what: str, rid: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an integer, got {value!r}", rid)
    return value


def _token_ids(value: Any, what: str, rid: str | None) -> list[int]:
    if isinstance(value, np.ndarray):
        ids = value.tolist()
    elif isinstance(value, list | tuple):
        ids = [_int(t, what, rid) for t in value]
    else:
        raise ProtocolError(f"{what} must be an array or list of integers", rid)
    if any(t < 0 for t in ids):
        raise ProtocolError(f"{what} must be non-negative", rid)
    return ids


def _structured(raw: Any, rid: str | None) -> StructuredSpec:
    """``{"kind": str, "value": str}``, exactly those keys (the spec's own checks follow in
    `SamplingParams.validate`)."""
    if not isinstance(raw, dict) or set(raw) != {"kind", "value"}:
        raise ProtocolError("structured must be a map with exactly 'kind' and 'value'", rid)
    kind, value = raw["kind"], raw["value"]
    if not isinstance(kind, str) or not isinstance(value, str):
        raise ProtocolError("structured 'kind' and 'value' must be strings", rid)
    return StructuredSpec(kind, value)


def parse_sampling(raw: Any, rid: str | None) -> SamplingParams:
    if not isinstance(raw, dict):
        raise ProtocolError("sampling must be a map", rid)
    unknown = sorted(str(k) for k in raw if k not in SAMPLING_KEYS)
    if unknown:
        raise ProtocolError(f"unknown sampling keys: {', '.join(unknown)}", rid)
    kw: dict[str, Any] = {}
    for key in ("max_tokens", "top_k", "min_tokens"):
        if key in raw:
            kw[key] = _int(raw[key], key, rid)
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ProtocolError(f"{key} must be a number, got {v!r}", rid)
            kw[key] = float(v)
    if raw.get("seed") is not None:
        kw["seed"] = _int(raw["seed"], "seed", rid)
    for key in ("logprobs", "prompt_logprobs"):
        if raw.get(key) is not None:
            kw[key] = _int(raw[key], key, rid)
    if "stop_token_ids" in raw:
        kw["stop_token_ids"] = tuple(_token_ids(raw["stop_token_ids"], "stop_token_ids", rid))
    if "ignore_eos" in raw:
        if not isinstance(raw["ignore_eos"], bool):
            raise ProtocolError("ignore_eos must be a boolean", rid)
        kw["ignore_eos"] = raw["ignore_eos"]
    if raw.get("structured") is not None:
        kw["structured"] = _structured(raw["structured"], rid)
    params = SamplingParams(**kw)
    try:
        params.validate()
    except ValueError as e:
        raise ProtocolError(str(e), rid) from None
    return params


def parse_add(header: dict[str, Any], *, max_prompt_chars: int | None = None,
              max_prompt_tokens: int | None = None) -> AddMessage:
    """Validate an ``add`` header into plain values the engine can use as they are.

    The size limits are checked first, before any per-token work, so an oversized prompt costs
    the receiver a length comparison, not a conversion."""
    rid = header.get("request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise ProtocolError(f"request_id must be a string of 1..{MAX_REQUEST_ID_LEN} characters")
    prompt, ids = header.get("prompt"), header.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise ProtocolError("give exactly one of prompt and prompt_token_ids", rid)
    if prompt is not None and not isinstance(prompt, str):
        raise ProtocolError("prompt must be a string", rid)
    if prompt is not None and max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise ProtocolError(f"prompt of {len(prompt)} characters exceeds max_prompt_chars "
                            f"{max_prompt_chars}", rid)
    if ids is not None and max_prompt_tokens is not None and isinstance(ids, np.ndarray | list) \
            and len(ids) > max_prompt_tokens:
        raise ProtocolError(f"prompt of {len(ids)} tokens cannot fit: max_model_len allows at "
                            f"most {max_prompt_tokens} prompt tokens", rid)
    token_ids = _token_ids(ids, "prompt_token_ids", rid) if ids is not None else None
    sampling = parse_sampling(header.get("sampling", {}), rid)
    priority = _int(header.get("priority", 0), "priority", rid)
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:   # telemetry carries it as int32
        raise ProtocolError(f"priority must be within {PRIORITY_MIN}..{PRIORITY_MAX}, got "
                            f"{priority}", rid)
    return AddMessage(rid, prompt, token_ids, sampling, priority)


def parse_abort(header: dict[str, Any]) -> list[str]:
    ids = header.get("request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ProtocolError("request_ids must be a list of strings")
    return ids


def encode_start_wave(wave: int) -> Frames:
    return encode({"type": START_WAVE, "wave": wave})


def encode_regroup(generation: int) -> Frames:
    return encode({"type": REGROUP, "generation": generation})


def _count(header: dict[str, Any], key: str) -> int:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f"{header.get('type')}: {key} must be an integer >= 0, got {value!r}")
    return value


def parse_start_wave(header: dict[str, Any]) -> int:
    """The wave number of a ``start_wave``."""
    return _count(header, "wave")


def parse_regroup(header: dict[str, Any]) -> int:
    """The group generation of a ``regroup``."""
    return _count(header, "generation")


# --- engine -> client ----------------------------------------------------------------------

def encode_ready(info: dict[str, Any]) -> Frames:
    return encode({"type": READY, **info})


def encode_heartbeat(engine_id: str) -> Frames:
    return encode({"type": HEARTBEAT, "engine_id": engine_id})


def encode_wave(event: str, wave: int) -> Frames:
    """A data-parallel rank's wave ``start`` (one of its requests started it) or
    ``complete`` (every rank drained)."""
    if event not in WAVE_EVENTS:
        raise ValueError(f"wave event must be one of {WAVE_EVENTS}, got {event!r}")
    return encode({"type": WAVE, "event": event, "wave": wave})


def parse_wave(header: dict[str, Any]) -> tuple[str, int]:
    """``(event, wave)`` of a ``wave`` message."""
    event = header.get("event")
    if event not in WAVE_EVENTS:
        raise ProtocolError(f"wave: event must be one of {', '.join(WAVE_EVENTS)}, got "
                            f"{event!r}")
    return event, _count(header, "wave")


def encode_error(reason: str, request_id: str | None = None, in_flight: bool = False) -> Frames:
    """``in_flight``: the message named a request of this client that is still running (a
    duplicate id, or a bad message reusing it); that request goes on and gets its own final
    output, so the client must not finish it on this error."""
    return encode({"type": ERROR, "reason": reason, "request_id": request_id,
                   "in_flight": in_flight})


def _output_to_wire(out: RequestOutput) -> dict[str, Any]:
    ids = out.new_token_ids
    return {
        "request_id": out.request_id,
        "new_token_ids": np.asarray(ids, dtype=TOKEN_DTYPE) if len(ids) > INLINE_MAX else list(ids),
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "text": out.text,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "num_output_tokens": out.num_output_tokens,
        "num_preemptions": out.num_preemptions,
        "error": out.error,
        **({"logprobs": [[lp, list(ids), list(lps)] for lp, ids, lps in out.logprobs]}
           if out.logprobs is not None else {}),
        **({"prompt_logprobs": _prompt_logprobs_to_wire(out.prompt_logprobs)}
           if out.prompt_logprobs is not None else {}),
        **({"timings": out.timings} if out.timings is not None else {}),
        **({"config_version": out.config_version} if out.config_version is not None else {}),
    }


def _prompt_logprobs_to_wire(p: PromptLogprobs) -> list[Any]:
    return [p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs]


def encode_outputs(outputs: Iterable[RequestOutput]) -> Frames:
    """One step's outputs for one client, as one message."""
    return encode({"type": OUTPUTS, "outputs": [_output_to_wire(o) for o in outputs]})


def _logprobs(raw: Any) -> list[tuple[float, list[int], list[float]]] | None:
    """An output's ``logprobs``: per token [logprob, [top ids], [top logprobs]]."""
    if raw is None:
        return None
    out = []
    for lp, ids, lps in raw:
        if len(ids) != len(lps):
            raise ValueError("logprobs: top ids and top logprobs differ in length")
        out.append((float(lp), [int(t) for t in ids], [float(x) for x in lps]))
    return out


def _prompt_logprobs(raw: Any) -> PromptLogprobs | None:
    """An output's ``prompt_logprobs``: [token logprobs, ranks, top ids, top logprobs]."""
    if raw is None:
        return None
    lps, ranks, top_ids, top_lps = raw
    if not len(lps) == len(ranks) == len(top_ids) == len(top_lps):
        raise ValueError("prompt_logprobs: columns differ in length")
    if any(len(i) != len(v) for i, v in zip(top_ids, top_lps, strict=True)):
        raise ValueError("prompt_logprobs: top ids and top logprobs differ in length")
    return PromptLogprobs([float(x) for x in lps], [int(r) for r in ranks],
                          [[int(t) for t in ids] for ids in top_ids],
                          [[float(x) for x in v] for v in top_lps])


def parse_outputs(header: dict[str, Any]) -> list[RequestOutput]:
    raw = header.get("outputs")
    if not isinstance(raw, list):
        raise ProtocolError("outputs must be a list")
    result = []
    for item in raw:
        try:
            ids = item["new_token_ids"]
            result.append(RequestOutput(
                request_id=item["request_id"],
                new_token_ids=ids.tolist() if isinstance(ids, np.ndarray) else list(ids),
                finished=bool(item["finished"]),
                finish_reason=item.get("finish_reason"),
                text=item.get("text"),
                num_prompt_tokens=int(item.get("num_prompt_tokens", 0)),
                num_cached_tokens=int(item.get("num_cached_tokens", 0)),
                num_output_tokens=int(item.get("num_output_tokens", 0)),
                num_preemptions=int(item.get("num_preemptions", 0)),
                error=item.get("error"),
                logprobs=_logprobs(item.get("logprobs")),
                prompt_logprobs=_prompt_logprobs(item.get("prompt_logprobs")),
                timings=(None if item.get("timings") is None    # phase -> seconds
                         else {str(k): float(v) for k, v in dict(item["timings"]).items()}),
                config_version=(None if item.get("config_version") is None
                                else int(item["config_version"])),
            ))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad output entry: {e}") from None
    return result
