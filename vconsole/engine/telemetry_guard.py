"""TelemetryGuard: what the busy loop does for observability can never stop it from serving.

The busy loop keeps caches beside the truth for telemetry (the waiting-row table, latency
windows and histograms, the KV fill counters) and builds snapshots from them between steps. A
bug there once killed the engine under load (a row cache that fell out of step raised on the
busy loop; the supervisor restarted it and every request in flight failed). Serving does not
need any of it, so every such call goes through `TelemetryGuard.run`:

- an exception is logged once per part with its traceback (later ones of that part only
  counted, so a cache that fails at 10 Hz does not flood the log);
- it is counted (`errors_total`, per part in `errors`): the ``health`` topic's
  ``telemetry_errors`` and Prometheus's ``vconsole:telemetry_errors_total``;
- ``on_failure(part, message)`` is told (the publisher raises a ``telemetry_error`` alert);
- ``rebuild(part)`` drops the part's caches so the next snapshot builds them from scratch;
- the call returns ``default`` and the loop goes on.

What is guarded is named by *part*: ``sched`` (request rows and queue figures), ``kv`` (fill
counters, block map), ``latency`` (observations and snapshots), ``step`` (step records, the
stats line), ``dp`` (a data-parallel rank's figures), ``kv_events`` (handing the KV cache events
to their publisher; nothing to rebuild). Only `Exception` is caught: a
KeyboardInterrupt or SystemExit still ends the process.

Invariant: `run` never raises an `Exception` (a failing ``rebuild`` or ``on_failure`` is
logged and counted too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("vconsole.engine")

T = TypeVar("T")


class TelemetryGuard:
    """See the module docstring. One per engine core; the busy loop's thread only."""

    def __init__(self, rebuild: Callable[[str], None] | None = None,
                 on_failure: Callable[[str, str], None] | None = None) -> None:
        self.rebuild = rebuild
        self.on_failure = on_failure
        self.errors_total = 0
        self.errors: dict[str, int] = {}
        self.last_error: str | None = None

    def run(self, part: str, fn: Callable[..., T], *args: Any,
            default: T | None = None) -> T | None:
        """``fn(*args)``, or ``default`` when it raised (logged, counted, rebuilt)."""
        try:
            return fn(*args)
        except Exception as e:
            self.failed(part, e)
            return default

    def failed(self, part: str, exc: BaseException) -> None:
        """Record one failure of ``part`` (see the module docstring)."""
        self.errors_total += 1
        count = self.errors[part] = self.errors.get(part, 0) + 1
        message = f"{type(exc).__name__}: {exc}"
        self.last_error = f"{part}: {message}"
        if count == 1:
            log.error("telemetry (%s) failed: %s — its caches are rebuilt and serving goes on; "
                      "later failures of %s are counted, not logged", part, message, part,
                      exc_info=exc)
        for hook, arg in ((self.rebuild, (part,)), (self.on_failure, (part, message))):
            if hook is None:
                continue
            try:
                hook(*arg)
            except Exception:
                self.errors_total += 1
                if count == 1:
                    log.exception("telemetry (%s): recovering from the failure failed too", part)
