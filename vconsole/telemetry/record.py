"""Recording the telemetry stream to a file, and reading it back (`vconsole record` / replay).

File format (little-endian throughout)::

    header:  MAGIC (8 bytes, b"VCTELREC") | u16 format version | u16 schema version
    record:  u64 body length | body
    body:    f64 receive time (unix s) | u32 frame count | (u64 frame length | frame bytes)*

Frames are stored exactly as received (topic, msgpack payload, raw buffers), so a replay
decodes them with `vconsole.telemetry.schema.decode` like live traffic. The body length prefix lets a
reader skip or detect a record cut short by a killed writer: `read_records` stops at such a
tail instead of failing, so a recording survives a crash up to its last complete record.

A recording of a vconsole engine also carries the engine's request trace of the same minutes
(`vconsole.telemetry.request_trace`), fetched over the control channel when the recording ends
(`fetch_trace`) and written beside it as ``<recording>.trace.jsonl`` (`trace_path`,
`save_trace`).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import zmq

from vconsole.security.curve import ClientCurve
from vconsole.telemetry.schema import SCHEMA_VERSION, TOPICS, SchemaVersionError
from vconsole.wire.control_client import ControlClient

MAGIC = b"VCTELREC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHH")
_LEN = struct.Struct("<Q")
_BODY_HEAD = struct.Struct("<dI")
TRACE_PROBE_S = 1.5     # is an engine answering on the control socket at all
TRACE_TIMEOUT_S = 60.0  # its answer to get_trace (minutes of trace serialized on its side)


def default_recordings_dir() -> Path:
    """Where the console's ``R`` writes recordings: ``$VCONSOLE_CACHE/recordings``, else
    ``~/.cache/vconsole/recordings`` (never the working directory, often a source tree)."""
    base = os.environ.get("VCONSOLE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "vconsole") / "recordings"


class RecordFormatError(ValueError):
    """Not a recording, or one in a format this code cannot read."""


def _frame_bytes(frame: Any) -> memoryview:
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


class Recorder:
    """Appends records to a new file (truncating any old one). Not thread-safe."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._fh.write(_HEADER.pack(MAGIC, FORMAT_VERSION, SCHEMA_VERSION))
        self.count = 0

    def write(self, frames: Sequence[Any], ts: float | None = None) -> None:
        """One message as received: bytes, memoryviews or zmq.Frames."""
        views = [_frame_bytes(f) for f in frames]
        size = _BODY_HEAD.size + sum(_LEN.size + v.nbytes for v in views)
        fh = self._fh
        fh.write(_LEN.pack(size))
        fh.write(_BODY_HEAD.pack(time.time() if ts is None else ts, len(views)))
        for v in views:
            fh.write(_LEN.pack(v.nbytes))
            fh.write(v)
        self.count += 1

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_header(fh: BinaryIO) -> tuple[int, int]:
    """(format version, schema version); raises RecordFormatError for a non-recording."""
    raw = fh.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:len(MAGIC)] != MAGIC:
        raise RecordFormatError(f"{getattr(fh, 'name', 'file')}: not a vconsole telemetry "
                                f"recording (bad magic)")
    _, fmt, schema_v = _HEADER.unpack(raw)
    if fmt != FORMAT_VERSION:
        raise RecordFormatError(f"recording format version {fmt}; this code reads "
                                f"{FORMAT_VERSION}")
    return fmt, schema_v


def read_records(path: str | os.PathLike[str], *, check_version: bool = True
                 ) -> Iterator[tuple[float, list[bytes]]]:
    """Yield ``(receive unix time, frames)`` in file order. A truncated last record ends the
    iteration quietly. With ``check_version``, a recording of another schema version raises
    SchemaVersionError up front (its payloads would not decode anyway)."""
    with open(path, "rb") as fh:
        _, schema_v = read_header(fh)
        if check_version and schema_v != SCHEMA_VERSION:
            raise SchemaVersionError(f"recording has schema version {schema_v}, this code "
                                     f"speaks version {SCHEMA_VERSION}")
        while True:
            head = fh.read(_LEN.size)
            if len(head) < _LEN.size:
                return
            (size,) = _LEN.unpack(head)
            body = fh.read(size)
            if len(body) < size:
                return
            ts, n = _BODY_HEAD.unpack_from(body)
            off = _BODY_HEAD.size
            frames = []
            mv = memoryview(body)
            for _ in range(n):
                if off + _LEN.size > size:
                    raise RecordFormatError(f"corrupt record at offset {fh.tell() - size}")
                (flen,) = _LEN.unpack_from(body, off)
                off += _LEN.size
                if off + flen > size:
                    raise RecordFormatError(f"corrupt record at offset {fh.tell() - size}")
                frames.append(bytes(mv[off:off + flen]))
                off += flen
            yield ts, frames


def record_stream(endpoint: str, path: str | os.PathLike[str], duration_s: float | None = None,
                  ctx: zmq.Context | None = None, curve: ClientCurve | None = None
                  ) -> dict[str, int]:
    """Subscribe to every topic on ``endpoint`` and write until ``duration_s`` (or Ctrl-C).
    Returns messages per topic. ``curve``: this client's keys, for an engine with CURVE keys."""
    ctx = ctx or zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sub)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.subscribe(b"")
    sub.connect(endpoint)
    counts = dict.fromkeys(TOPICS, 0)
    deadline = None if duration_s is None else time.monotonic() + duration_s
    last_flush = time.monotonic()
    try:
        with Recorder(path) as rec:
            while deadline is None or time.monotonic() < deadline:
                timeout = 200 if deadline is None else max(0, min(200, int(
                    (deadline - time.monotonic()) * 1000)))
                if not sub.poll(timeout):
                    continue
                frames = sub.recv_multipart(copy=False)
                rec.write(frames)
                topic = bytes(frames[0].buffer).decode("ascii", "replace")
                counts[topic] = counts.get(topic, 0) + 1
                if time.monotonic() - last_flush > 1.0:
                    rec.flush()
                    last_flush = time.monotonic()
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(0)
    return counts


# --- the request trace beside a recording --------------------------------------------------------

def trace_path(recording: str | os.PathLike[str]) -> Path:
    """Where a recording's request trace goes: ``<recording>.trace.jsonl``."""
    return Path(f"{os.fspath(recording)}.trace.jsonl")


def fetch_trace(control_endpoint: str, window_s: float | None = None, *,
                curve: ClientCurve | None = None, probe_s: float = TRACE_PROBE_S,
                timeout_s: float = TRACE_TIMEOUT_S) -> str:
    """The engine's request trace of the last ``window_s`` seconds (None: all it keeps) as
    JSON lines. Asks ``get_config`` first, so that no engine costs ``probe_s``, not the long
    ``timeout_s`` a big trace may need. Raises TimeoutError or `ControlError`."""
    with ControlClient(control_endpoint, timeout_s=probe_s, curve=curve) as client:
        client.get_config()
        client.timeout_s = timeout_s
        return client.get_trace(window_s)


def save_trace(path: str | os.PathLike[str], text: str) -> dict[str, int]:
    """Write a trace's JSON lines to ``path`` whole (a temporary file renamed into place, so
    a reader never finds half of it); lines per record kind."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return count_trace_lines(text)


def count_trace_lines(text: str) -> dict[str, int]:
    """Lines per record kind (header, config, request, step) of a trace's JSON lines."""
    counts = dict.fromkeys(("header", "config", "request", "step"), 0)
    for line in text.splitlines():
        if line.startswith('{"kind":"'):
            kind = line[9:line.find('"', 9)]
            counts[kind] = counts.get(kind, 0) + 1
    return counts
