"""Where the CPU attention kernel's builds live, and whether one is being built now.

Standard library only, so that anything waiting for an engine — a launcher, `vconsole doctor`,
the console's "waiting for telemetry" line — can tell "the engine is compiling its kernel (first
start only)" from "no engine" without importing torch or the worker. The builder itself is
`vconsole.engine.worker.attention_kernel`; it writes the marker read here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vconsole.shared.procs import pid_alive

KERNEL_CACHE_ENV = "VCONSOLE_KERNEL_CACHE"
ENTRY_PREFIX = "paged_attention-"
BUILDING = "building.json"        # {"pid", "since"}: written by the builder while it builds
# What a waiting client is told (the engine's log, `vconsole demo`, doctor, the console).
COMPILING = "compiling the attention kernel (first start only)"
# How long that takes where no earlier build on this machine says better (`attention_kernel`).
EXPECTED_BUILD = "about 10-30 s on 2 cores"


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$VCONSOLE_KERNEL_CACHE`` if set, else ``$VCONSOLE_CACHE/kernels`` (default
    ``~/.cache/vconsole/kernels``), read at each call so a test or a second checkout can point it
    elsewhere; ``environ``: another process's environment (a launcher asking where its engine
    builds). The test suite points the kernel at the one `make install` built while each test's
    models and keys go to folders of its own: a fresh ``VCONSOLE_CACHE`` would otherwise compile
    the kernel again (`EXPECTED_BUILD` each)."""
    environ = os.environ if environ is None else environ
    if own := environ.get(KERNEL_CACHE_ENV):
        return Path(own).expanduser()
    env = environ.get("VCONSOLE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "vconsole"
    return base / "kernels"


def build_in_progress(root: Path | None = None) -> dict[str, Any] | None:
    """A kernel build running now on this machine (``{"pid", "since", "entry"}``), else None.
    Reads only the cache folder: cheap enough to poll while waiting for an engine. A marker
    left by a builder that died is ignored."""
    root = root if root is not None else cache_root()
    for marker in sorted(root.glob(f"{ENTRY_PREFIX}*/{BUILDING}")):
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("pid"), int) \
                and pid_alive(record["pid"]):
            return {**record, "entry": str(marker.parent)}
    return None
