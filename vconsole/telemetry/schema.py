"""The telemetry wire schema: the one module both the publisher and every subscriber import.

A message is a ZeroMQ multipart: ``[topic, payload, *buffers]``. ``topic`` is one of `TOPICS` as
ASCII (so SUB prefix filtering works), ``payload`` is a msgpack map, and each extra frame is a raw
buffer (e.g. the KV block-state array) referenced from the payload as
``{"buffer": i, "dtype": "uint8", "shape": [n]}`` where ``i`` indexes the extra frames. Raw
buffers travel without copies on either side: numpy arrays in a payload become frames on
`encode`, and `TelemetryMessage.array` is ``np.frombuffer`` over the received frame.

Invariants a decoded `TelemetryMessage` satisfies: its topic is in `TOPICS`; its payload has the
envelope fields (`ENVELOPE`) with the right types and ``v == SCHEMA_VERSION``; every buffer
reference in it points at an existing frame whose size matches dtype x shape. Fields beyond the
envelope are not enforced here (a newer publisher may add fields; `missing_fields` tells which
of a topic's documented minimum fields are absent). See docs/PROTOCOL.md for each topic.

The ``sched`` topic's ``requests`` table is columnar on the wire: ids as a list, the state
as uint8 codes and the counts and ages as raw buffers (`vconsole.telemetry.request_columns`),
so 10,000 rows cost the publisher no Python per row. `encode` accepts a `RequestTable`, a
`RequestColumns`, a column map or a list of row maps; `decode` accepts those wire forms and the
older ones (column -> list, a list of rows: recordings hold them) and always hands back a
`RequestColumns` (numpy columns that also read as a sequence of row dicts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import numpy as np

from vconsole.telemetry.request_columns import REQUEST_COLUMNS as REQUEST_COLUMNS
from vconsole.telemetry.request_columns import RequestColumns as RequestColumns
from vconsole.telemetry.request_columns import from_wire, to_wire

SCHEMA_VERSION: int = 1
TOPICS = ("health", "step", "sched", "kv", "gpu", "host", "config", "alert", "latency",
          "dp", "wave")
# Sent only by the ranks of a data-parallel group (`vconsole engine --data-parallel-size N`);
# a lone engine never sends them.
DP_TOPICS = ("dp", "wave")
_TOPIC_BYTES = {t.encode("ascii"): t for t in TOPICS}

# Envelope: every payload carries these. seq counts per topic per publisher, from 0.
ENVELOPE: dict[str, tuple[type, ...]] = {
    "v": (int,), "ts": (int, float), "engine": (str,), "rank": (int,), "seq": (int,),
}


# The documented minimum fields per topic (beyond the envelope). Informational: `decode` does
# not enforce them, `missing_fields` reports them, the publisher's tests check it sends them all.
TOPIC_FIELDS: dict[str, tuple[str, ...]] = {
    "health": ("state", "uptime_s", "steps", "interval_s"),
    "step": ("steps", "window_s", "phase_s", "step_time_p50_s", "step_time_max_s",
             "num_prefill_tokens", "num_decode_tokens", "tokens_per_s", "steps_per_s",
             "sched_share"),
    "sched": ("num_waiting", "num_running", "num_preempted", "num_preemptions_total",
              "num_finished_total", "num_prompt_tokens_total", "num_generation_tokens_total",
              "max_num_seqs", "max_num_batched_tokens", "policy", "requests",
              "requests_truncated"),
    "kv": ("num_blocks", "block_size", "num_free", "num_used", "num_cached", "num_shared",
           "usage", "token_usage", "fragmentation", "prefix_queries", "prefix_hits",
           "prefix_hit_rate", "block_states", "cache_dtype", "bytes_per_token",
           "capacity_tokens", "pool_bytes"),
    "gpu": ("available", "devices", "error"),
    "host": ("proc_cpu_percent", "proc_rss_bytes", "proc_num_threads", "sys_cpu_percent",
             "sys_mem_used", "sys_mem_total"),
    "config": ("version", "values", "schema"),
    "alert": ("name", "level", "value", "threshold", "message"),
    "latency": ("window_s", "overall", "priority", "finished"),
    # Data parallel, per rank, at the snapshot rate: the wave it is in, its share of dummy
    # steps (run while idle so the group's collective steps stay in lockstep) and the cost of
    # the "is anyone busy" all-reduce run every ``sync_every`` steps.
    "dp": ("world_size", "wave", "wave_running", "group_generation", "group_state",
           "steps_total", "dummy_steps_total", "dummy_share", "sync_every",
           "sync_count_total", "sync_s_total", "sync_s_per_step"),
    # Data parallel, an event: a wave started on this rank, or completed (every rank drained;
    # each rank sends its own, with the same wave number).
    "wave": ("event", "wave", "steps", "dummy_steps", "duration_s"),
}

# "restarting": sent by the engine's supervisor while no engine process runs (between a crash
# and the next start); health then also says why (``restart_reason``) and how often.
HEALTH_STATES = ("idle", "running", "draining", "restarting")
ALERT_LEVELS = ("ok", "warning", "critical")


class SchemaError(ValueError):
    """A frame set that is not a valid telemetry message; the message says why."""


class SchemaVersionError(SchemaError):
    """The payload's schema version ``v`` is not the one this code speaks."""


Buffer = bytes | bytearray | memoryview


@dataclass
class TelemetryMessage:
    """One decoded message. ``buffers`` are the raw frames after the payload, uncopied."""

    topic: str
    payload: dict[str, Any]
    buffers: list[Buffer] = field(default_factory=list)

    @property
    def seq(self) -> int:
        return self.payload["seq"]

    @property
    def ts(self) -> float:
        return self.payload["ts"]

    @property
    def engine(self) -> str:
        return self.payload["engine"]

    @property
    def rank(self) -> int:
        return self.payload["rank"]

    def array(self, key: str) -> np.ndarray:
        """The numpy array a payload field references: read-only, a view over the frame."""
        ref = self.payload.get(key)
        if not is_buffer_ref(ref):
            raise SchemaError(f"{self.topic}: field {key!r} is not a buffer reference")
        return _view(ref, self.buffers)

    def block_states(self) -> np.ndarray:
        """kv only: uint8 per block (0 free, 1 used, 2 cached-free, 3 shared), zero-copy."""
        if self.topic != "kv":
            raise SchemaError(f"block_states() is only on kv messages, not {self.topic}")
        return self.array("block_states")


def is_buffer_ref(obj: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(obj, dict) and "buffer" in obj and "dtype" in obj and "shape" in obj


def make_envelope(engine: str, rank: int, seq: int, ts: float) -> dict[str, Any]:
    return {"v": SCHEMA_VERSION, "ts": ts, "engine": engine, "rank": rank, "seq": seq}


def missing_fields(topic: str, payload: dict[str, Any]) -> list[str]:
    """The documented minimum fields of ``topic`` that ``payload`` lacks (envelope included)."""
    want = (*ENVELOPE, *TOPIC_FIELDS.get(topic, ()))
    return [k for k in want if k not in payload]


# --- encode ---------------------------------------------------------------------------------

def _default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a telemetry payload")



def _lift_arrays(obj: dict[str, Any], frames: list[Buffer]) -> dict[str, Any]:
    """Copy of ``obj`` with every ndarray (in it or nested maps; lists are not searched, so a
    large column costs nothing here) replaced by a buffer reference to a frame appended to
    ``frames``. Arrays are sent little-endian and C-contiguous; contiguous ones are not
    copied."""
    out: dict[str, Any] = {}
    for k, val in obj.items():
        if isinstance(val, np.ndarray):
            arr = val
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            arr = np.ascontiguousarray(arr)
            if arr.dtype.hasobject:
                raise SchemaError(f"field {k!r}: object arrays cannot be sent as buffers")
            out[k] = {"buffer": len(frames), "dtype": arr.dtype.name, "shape": list(arr.shape)}
            frames.append(arr.data.cast("B") if arr.size else b"")
        elif isinstance(val, dict):
            out[k] = _lift_arrays(val, frames)
        else:
            out[k] = val
    return out


def encode(topic: str, payload: dict[str, Any], buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """Frames for one message: ``[topic bytes, msgpack payload, *buffers, *lifted arrays]``.

    ``v`` is filled in if absent; the other envelope fields must be there (a sender fails here
    rather than every receiver failing later). ``buffers`` are explicit raw frames the payload
    already references by index; numpy arrays found in the payload are appended after them.
    The caller's dict is not modified. Send with ``send_multipart(frames, copy=False)``.
    """
    if topic not in TOPICS:
        raise SchemaError(f"unknown topic {topic!r}; expected one of {', '.join(TOPICS)}")
    if not isinstance(payload, dict):
        raise SchemaError(f"{topic}: payload must be a dict, got {type(payload).__name__}")
    frames: list[Buffer] = list(buffers)
    if topic == "sched" and "requests" in payload:
        try:
            payload = {**payload, "requests": to_wire(payload["requests"])}
        except (ValueError, TypeError, KeyError) as e:
            raise SchemaError(f"{topic}: bad 'requests' table: {e}") from e
    body = _lift_arrays(payload, frames)
    body.setdefault("v", SCHEMA_VERSION)
    _check_envelope(topic, body)
    try:
        packed = msgpack.packb(body, use_bin_type=True, default=_default)
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{topic}: payload cannot be encoded: {e}") from e
    return [_topic_frame(topic), packed, *frames]


def _topic_frame(topic: str) -> bytes:
    return topic.encode("ascii")


# --- decode ---------------------------------------------------------------------------------

def _as_buffer(frame: Any) -> Buffer:
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    if buf is not None:
        return buf
    raise SchemaError(f"a frame must be bytes-like, got {type(frame).__name__}")


def _check_envelope(topic: str, payload: dict[str, Any]) -> None:
    if "v" not in payload:
        raise SchemaError(f"{topic}: payload has no schema version 'v'")
    v = payload["v"]
    if not isinstance(v, int) or isinstance(v, bool):
        raise SchemaError(f"{topic}: schema version 'v' must be an integer, got {v!r}")
    if v != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{topic}: message has schema version {v}, this code speaks version "
            f"{SCHEMA_VERSION}")
    for key, types in ENVELOPE.items():
        if key not in payload:
            raise SchemaError(f"{topic}: payload lacks envelope field {key!r}")
        val = payload[key]
        if isinstance(val, bool) or not isinstance(val, types):
            want = " or ".join(t.__name__ for t in types)
            raise SchemaError(f"{topic}: envelope field {key!r} must be {want}, got {val!r}")


def _view(ref: dict[str, Any], buffers: Sequence[Buffer]) -> np.ndarray:
    arr = np.frombuffer(buffers[ref["buffer"]], dtype=np.dtype(ref["dtype"]).newbyteorder("<"))
    arr = arr.reshape(ref["shape"])
    arr.flags.writeable = False  # one received frame may be shared by several readers
    return arr


def _check_refs(topic: str, obj: dict[str, Any], buffers: Sequence[Buffer], path: str) -> None:
    for k, val in obj.items():
        if not isinstance(val, dict):
            continue
        where = f"{path}{k}"
        if "buffer" not in val:
            _check_refs(topic, val, buffers, where + ".")
            continue
        i, dt, shape = val.get("buffer"), val.get("dtype"), val.get("shape")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(buffers):
            raise SchemaError(f"{topic}: {where} references buffer {i!r} but the message has "
                              f"{len(buffers)} buffer frame(s)")
        try:
            if not isinstance(dt, str):
                raise TypeError
            dtype = np.dtype(dt)
        except TypeError:
            raise SchemaError(f"{topic}: {where} has unknown dtype {dt!r}") from None
        if dtype.hasobject:
            raise SchemaError(f"{topic}: {where} has non-numeric dtype {dt!r}")
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise SchemaError(f"{topic}: {where} has invalid shape {shape!r}")
        need = math.prod(shape) * dtype.itemsize
        have = memoryview(buffers[i]).nbytes
        if need != have:
            raise SchemaError(f"{topic}: {where} is {dt}{shape} = {need} bytes but buffer {i} "
                              f"holds {have}")


def peek(frames: Sequence[Any]) -> tuple[str, str, int, int] | None:
    """``(topic, engine, rank, seq)`` of a message without decoding its payload: the envelope
    leads every payload our publisher sends, so only its first entries are read. None when
    they are not there (the caller then decodes the message as usual); not a validation."""
    if len(frames) < 2:
        return None
    topic = _TOPIC_BYTES.get(bytes(_as_buffer(frames[0])))
    if topic is None:
        return None
    up = msgpack.Unpacker(raw=False)
    found: dict[str, Any] = {}
    try:
        up.feed(_as_buffer(frames[1]))
        for _ in range(min(up.read_map_header(), len(ENVELOPE))):
            key = up.unpack()
            found[key] = up.unpack()
    except Exception:  # garbage: let decode say what is wrong
        return None
    engine, rank, seq = found.get("engine"), found.get("rank"), found.get("seq")
    if isinstance(engine, str) and isinstance(rank, int) and isinstance(seq, int):
        return topic, engine, rank, seq
    return None


def decode(frames: Sequence[Any]) -> TelemetryMessage:
    """Parse and validate one multipart message. Accepts bytes, memoryviews or ``zmq.Frame``s
    (receive with ``copy=False`` to keep big buffers uncopied). Raises `SchemaError` saying
    what is wrong, `SchemaVersionError` for a payload of another schema version."""
    if len(frames) < 2:
        raise SchemaError(f"expected at least 2 frames (topic, payload), got {len(frames)}")
    topic_raw = bytes(_as_buffer(frames[0]))
    topic = _TOPIC_BYTES.get(topic_raw)
    if topic is None:
        raise SchemaError(f"unknown topic {topic_raw[:40]!r}; expected one of "
                          f"{', '.join(TOPICS)}")
    try:
        payload = msgpack.unpackb(_as_buffer(frames[1]), raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise SchemaError(f"{topic}: payload is not valid msgpack ({type(e).__name__}: {e})") \
            from None
    if not isinstance(payload, dict):
        raise SchemaError(f"{topic}: payload must be a map, got {type(payload).__name__}")
    _check_envelope(topic, payload)
    buffers = [_as_buffer(f) for f in frames[2:]]
    _check_refs(topic, payload, buffers, "")
    if topic == "sched" and "requests" in payload:
        try:
            payload["requests"] = from_wire(payload["requests"], lambda r: _view(r, buffers))
        except (ValueError, TypeError) as e:
            raise SchemaError(f"{topic}: bad 'requests' table: {e}") from None
    return TelemetryMessage(topic, payload, buffers)
