"""Helpers for testing the console without an engine: payload frames, a fake control channel,
and an app driven by a recording (used by tests/test_console*.py and scripts/screenshots.py).

`FakeControl` answers exactly as the engine does — it runs `vconsole.engine.config.apply_update` and
builds the reply with `vconsole.telemetry.control.config_reply` — so the console's handling of applied /
rejected / restart-required is tested against the real rules.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from vconsole.engine.config import EngineConfig, apply_update
from vconsole.telemetry.schema import encode, make_envelope

DATA = Path(__file__).resolve().parent.parent / "data"
RECORDING = DATA / "synthetic.vrec"


def frames(topic: str, body: dict[str, Any], *, seq: int = 0, ts: float = 1_700_000_000.0,
           engine: str = "tiny-0", rank: int = 0) -> list[Any]:
    """One encoded message, as a publisher sends it."""
    return encode(topic, {**make_envelope(engine, rank, seq, ts), **body})


def foreign_version_frames(topic: str = "health", version: int = 99) -> list[bytes]:
    """A message from a publisher speaking another schema version (encode refuses to make one)."""
    payload = {"v": version, "ts": 1.0, "engine": "future-0", "rank": 0, "seq": 0,
               "state": "running", "uptime_s": 1.0, "steps": 0, "interval_s": 1.0}
    return [topic.encode(), msgpack.packb(payload, use_bin_type=True)]


class FakeControl:
    """An in-memory control channel with the engine's validation. ``down`` makes every call
    time out, like an engine that is not running."""

    def __init__(self, config: EngineConfig | None = None, version: int = 1) -> None:
        self.config = config or EngineConfig(num_kv_blocks=1024, max_num_seqs=32)
        self.version = version
        self.down = False
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self._lock = threading.Lock()

    def _reply(self, update: Any = None) -> dict[str, Any]:
        from vconsole.telemetry.control import config_reply

        return config_reply(self.version, self.config.to_dict(), update)

    def get_config(self) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("get_config", None))
            if self.down:
                raise TimeoutError("no reply from the engine's control socket (fake, down)")
            return self._reply()

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("set_config", dict(values)))
            if self.down:
                raise TimeoutError("no reply from the engine's control socket (fake, down)")
            update = apply_update(self.config, values)
            if update.applied:
                self.config = update.config
                self.version += 1
            return self._reply(update)


def replay_app(path: str | Path = RECORDING, *, control: Any = None, readonly: bool = False,
               clock: Any = None, records: Sequence[tuple[float, Sequence[Any]]] | None = None,
               **kw: Any) -> Any:
    """A VConsoleApp fed instantly from ``path`` (or ``records``); writable when a control is
    given (unless ``readonly``)."""
    from vconsole.console.app import VConsoleApp
    from vconsole.console.source import ReplaySource

    src = ReplaySource(path, speed=0, records=(lambda: iter(records)) if records is not None
                       else None, readonly=control is None)
    return VConsoleApp(source=src, control=control, readonly=readonly, clock=clock, **kw)
