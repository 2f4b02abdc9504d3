"""Reloading the engine's TOML config file: noticing a change, and applying it like a `set`.

`ConfigFileWatcher` only *notices* (it polls the file's mtime and size about once a second, off
the busy loop); the busy loop then calls `apply_file` between two steps, so a file edit goes
through exactly the validation a ``vconsole set`` does (`vconsole.shared.config.apply_update`).

Semantics of a reload: the hot keys in the file are applied as one all-or-nothing update (they
override earlier ``set``\\ s and flags for those keys); restart-only keys whose file value differs
from the running one are reported as ``restart_required`` and left alone, so a file that also
changes e.g. ``model`` still has its hot part applied.
"""

from __future__ import annotations

import logging
import os
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.engine.config_source import load_toml
from vconsole.shared.config import RESTART_KEYS, ConfigUpdate, EngineConfig, apply_update

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class ConfigFileWatcher:
    """A daemon thread that calls ``on_change()`` when the file's (mtime, size) changes.

    ``on_change`` runs on the watcher thread and must only hand off (e.g. put on a queue)."""

    def __init__(self, path: str | os.PathLike[str], on_change: Callable[[], None],
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self.path = Path(path)
        self._on_change = on_change
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._last = _signature(self.path)
        self._thread = threading.Thread(target=self._run, name="config-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            sig = _signature(self.path)
            if sig != self._last:
                self._last = sig
                if sig is not None:
                    self._on_change()


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's raw values; raises ValueError with a readable reason."""
    try:
        return load_toml(Path(path))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None


def apply_file(apply: Callable[[dict[str, Any]], ConfigUpdate], current: EngineConfig,
               values: dict[str, Any]) -> ConfigUpdate:
    """Apply a reloaded file's values: hot (and unknown) keys through ``apply`` (the core's
    `apply_config`), restart-only keys only checked. The result merges both answers."""
    restart_part = {k: v for k, v in values.items() if k in RESTART_KEYS}
    hot_part = {k: v for k, v in values.items() if k not in RESTART_KEYS}
    check = apply_update(current, restart_part)  # restart keys only: never changes anything
    update = apply(hot_part) if hot_part else ConfigUpdate(current)
    update.rejected.update(check.rejected)
    update.restart_required = sorted(set(update.restart_required) | set(check.restart_required))
    return update
