"""A fleet recorded into one file, and played back as a fleet.

`record_fleet` runs every target's source (`vconsole.console.sources.fleet.snapshot.FleetWatch`)
and writes every message each one reads into one recording (`SharedRecorder`: one file, many
reader threads), each under its **target's name** (`renamed`: our engines call themselves
``engine-0`` and would fold into one in the replay). The file is an ordinary recording:
`vconsole replay` plays it.

`recorded_targets` reads a recording's engine names and kinds back (a message's ``source``:
``vllm``, ``sglang``, ``llama-cpp``; none: ours). A recording of several engine names is a
fleet: `vconsole replay` then opens on the Fleet screen, each row a `RecordedSource` over the
one `ReplaySource`, its URL ``(recorded)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from vconsole.console.sources.fleet.targets import Target
from vconsole.telemetry.record import Recorder, read_records
from vconsole.telemetry.schema import peek

RECORDED = "(recorded)"


def renamed(frames: Sequence[Any], name: str) -> list[Any]:
    """The same message under engine ``name``: only the payload frame is re-packed (its
    buffers, the block map among them, are kept as they are)."""
    head = bytes(frames[1]) if not isinstance(frames[1], bytes) else frames[1]
    body = msgpack.unpackb(head, raw=False)
    if body.get("engine") == name:
        return list(frames)
    body["engine"] = name
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


class SharedRecorder:
    """One recording written by several reader threads (a `Recorder` is not thread-safe).
    Writes after `close` are dropped: the sources stop one after another."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._rec = Recorder(path)
        self._lock = threading.Lock()
        self.closed = False

    @property
    def count(self) -> int:
        return self._rec.count

    def write(self, frames: Sequence[Any], ts: float | None = None) -> None:
        with self._lock:
            if not self.closed:
                self._rec.write(frames, ts)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._rec.close()


def record_fleet(targets: Sequence[Target], path: str | Path, duration_s: float | None,
                 log: Callable[[str], None] = print) -> tuple[int, list[str]]:
    """Record every target until ``duration_s`` (None: Ctrl-C): (messages, problems)."""
    from vconsole.console.sources.fleet.snapshot import FleetWatch, build_sources

    sources, problems = build_sources(targets)
    rec = SharedRecorder(path)
    for s in sources:
        s.record_into(rec)
    watch = FleetWatch(sources).start()
    log(f"recording {len(sources)} target(s) to {path}"
        + (f" for {duration_s:g} s" if duration_s else " until Ctrl-C"))
    try:
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()
        rec.close()
    problems += [f"{s.target.name}: {s.problem}" for s in sources if s.problem]
    return rec.count, problems


def recorded_targets(path: str | Path) -> tuple[list[Target], float]:
    """The engines a recording holds, in the order first heard, with their kinds (from their
    first ``health``), and the recording's first time."""
    kinds: dict[str, str] = {}
    healthy: set[str] = set()
    first: float | None = None
    for ts, frames in read_records(path):
        first = ts if first is None else first
        head = peek(frames)
        if head is None:
            continue
        topic, engine = head[0], head[1]
        kinds.setdefault(engine, "vconsole")
        if topic == "health" and engine not in healthy:
            healthy.add(engine)
            kinds[engine] = _kind(frames)
    return [Target(name, kind, RECORDED) for name, kind in kinds.items()], first or 0.0


def _kind(frames: Sequence[Any]) -> str:
    body = msgpack.unpackb(bytes(frames[1]), raw=False)
    source = body.get("source")
    return source if source in ("vllm", "sglang", "llama-cpp") else "vconsole"


class RecordedSource:
    """One engine of a recorded fleet, for the rows (`vconsole.console.sources.fleet.rows`):
    the replay's engine keys of its name."""

    problem: str | None = None
    starting = False

    def __init__(self, target: Target, replay: Any) -> None:
        self.target = target
        self.replay = replay

    @property
    def engine_keys(self) -> list[str]:
        return [k for k in list(self.replay.engine_keys)
                if k.rsplit("/", 1)[0] == self.target.name]
