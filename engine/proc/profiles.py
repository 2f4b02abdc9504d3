"""Profiles on demand as the control thread sees them: ids, progress and results.

The busy loop owns the profiler itself (`EngineCore.start_profile`,
`vconsole.engine.worker.profiler`): it starts a profile (`ProfileBook.start`, from a
``profile_start`` control call), notes its progress after every step (`after_step`) and cancels
it (`cancel`). The control thread answers ``profile_status`` from `view` at any time, without
waiting for a step boundary.

Invariants: only the busy loop calls `start`, `after_step` and `cancel`; a status is plain data
(msgpack-able), replaced whole under the lock and never changed in place, so `view` may hand it
out as is; at most one profile runs at a time; the last `KEEP` profiles stay readable.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("vconsole.engine")

KEEP = 8                      # finished profiles kept for profile_status
RUNNING, DONE, CANCELLED, FAILED = "running", "done", "cancelled", "failed"
SLOWER = ("the engine keeps serving while it profiles, but each profiled step runs slower "
          "(torch.profiler records every operator and each layer is labelled)")


class ProfileBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._ids = itertools.count(1)
        self._profiler: Any = None          # the running StepProfiler (busy loop only)
        self.active: str | None = None      # the running profile's id

    # --- busy loop ----------------------------------------------------------------------------

    def start(self, core: Any, steps: int) -> dict[str, Any]:
        """Arm a profile of the next ``steps`` steps; its status. Raises ValueError with the
        reason (one is running, this core cannot profile)."""
        if self.active is not None:
            raise ValueError(f"profile {self.active} is running "
                             f"({self._profiler.steps_done}/{self._profiler.num_steps} steps "
                             "done); wait for it or cancel it")
        if not hasattr(core, "start_profile"):
            raise ValueError("this engine cannot profile")
        self._profiler = core.start_profile(steps)
        pid = f"p{next(self._ids)}"
        self.active = pid
        self._put(pid, {"id": pid, "state": RUNNING, "steps": steps, "steps_done": 0,
                        "profiling": True, "started_ts": time.time(), "finished_ts": None,
                        "slowdown_note": SLOWER, "result": None, "error": None})
        log.warning("profile %s: profiling the next %d steps with torch.profiler; %s", pid,
                    steps, SLOWER)
        return self.view(pid) or {}

    def after_step(self) -> None:
        """Note the running profile's progress; its result once it is done."""
        prof, pid = self._profiler, self.active
        if prof is None or pid is None:
            return
        if not prof.done:
            if prof.steps_done != (self.view(pid) or {}).get("steps_done"):
                self._update(pid, steps_done=prof.steps_done)
            return
        if prof.result is not None:
            r = prof.result
            self._finish(pid, DONE, result={"id": pid, **r})
            log.info("profile %s done: %d steps in %.2f s (mean step %.1f ms, profiled)", pid,
                     r["steps"], r["wall_s"], r["mean_step_s"] * 1e3)
        else:
            self._finish(pid, FAILED, error=prof.error or "the profiler stopped")
            log.error("profile %s failed: %s", pid, prof.error)

    def cancel(self, pid: str | None, reason: str = "cancelled") -> dict[str, Any]:
        """Cancel profile ``pid`` (None: the running one, if any); its status. Raises
        ValueError for an unknown id; a finished one is returned as is."""
        status = self.view(pid) if pid is not None else None
        if pid is not None and status is None:
            raise ValueError(f"no profile {pid!r}")
        if self.active is None or (pid is not None and pid != self.active):
            return status or {}
        pid = self.active
        self._profiler.cancel()
        self._finish(pid, CANCELLED, error=reason)
        log.info("profile %s %s after %d steps", pid, reason, self._last_done(pid))
        return self.view(pid) or {}

    # --- any thread ---------------------------------------------------------------------------

    def view(self, pid: str) -> dict[str, Any] | None:
        with self._lock:
            return self._status.get(pid)

    # --- internals ----------------------------------------------------------------------------

    def _put(self, pid: str, status: dict[str, Any]) -> None:
        with self._lock:
            self._status[pid] = status
            while len(self._status) > KEEP:
                self._status.popitem(last=False)

    def _update(self, pid: str, **changes: Any) -> None:
        with self._lock:
            self._status[pid] = {**self._status[pid], **changes}

    def _last_done(self, pid: str) -> int:
        return int((self.view(pid) or {}).get("steps_done", 0))

    def _finish(self, pid: str, state: str, *, result: dict[str, Any] | None = None,
                error: str | None = None) -> None:
        prof = self._profiler
        self._update(pid, state=state, steps_done=prof.steps_done, profiling=False,
                     finished_ts=time.time(), result=result, error=error)
        self._profiler = None
        self.active = None
