"""Profiles on demand as the control thread sees them: ids, progress and results.

The busy loop owns the profiler itself (`EngineCore.start_profile`,
`vconsole.engine.worker.profiler`): it starts a profile (`ProfileBook.start`, from a
``profile_start`` control call), notes its progress after every step (`after_step`) and cancels
it (`cancel`). The profiler settles a profile (`_settle`: its result, or why it failed) from the
thread that builds its report. The control thread answers ``profile_status`` from `view` at any
time, without waiting for a step boundary.

``nsys``: instead of torch.profiler, an `NsysCapture` opens Nsight Systems' capture range
(``cudaProfilerStart``, `vconsole.engine.worker.nvtx`) at once, between two steps, and closes it
(``cudaProfilerStop``) after the N-th step; under ``nsys profile --capture-range=cudaProfilerApi``
only those steps are recorded, with the NVTX ranges of the hot key ``nvtx``. It has the same
status and life as a torch profile (one at a time, cancel closes the range).

Invariants: only the busy loop calls `start`, `after_step` and `cancel`; everything is read and
written under one lock; a status is plain data (msgpack-able), replaced whole and never changed
in place, so `view` may hand it out as is; at most one profile runs at a time (``active``) and
it ends exactly once (done, failed or cancelled); the last `KEEP` profiles stay readable.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vconsole.engine.process.serving_core import ServingCore
    from vconsole.engine.worker.profiler import StepProfiler

log = logging.getLogger("vconsole.engine")

KEEP = 8                      # finished profiles kept for profile_status
RUNNING, DONE, CANCELLED, FAILED = "running", "done", "cancelled", "failed"
SLOWER = ("the engine keeps serving while it profiles, but each profiled step runs slower "
          "(torch.profiler records every operator and each layer is labelled)")
NSYS_NOTE = ("Nsight Systems records only inside the capture range when the engine runs under "
             "`nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi "
             "--capture-range-end=stop vconsole engine ...`; elsewhere the range is a no-op")


class NsysCapture:
    """The next ``num_steps`` steps inside ``cudaProfilerStart/Stop``; the `StepProfiler`
    fields `ProfileBook` reads (``steps_done``, ``num_steps``, ``reporting``, ``result``,
    ``error``, `cancel`). Opens the range in the constructor: ValueError without CUDA."""

    reporting = False

    def __init__(self, core: ServingCore, num_steps: int,
                 on_done: Callable[[], None]) -> None:
        from vconsole.engine.worker import nvtx

        self._nvtx = nvtx
        self.device = core.model_info()["device"]
        self.device_type = str(self.device).split(":", 1)[0]
        self.num_steps = num_steps
        self.steps_done = 0
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self._on_done = on_done
        self._first_step = int(getattr(core, "num_steps", 0))
        self._ranges = bool(core.config.nvtx) and nvtx.ON
        nvtx.capture_start(self.device_type)       # raises ValueError: no CUDA
        self._t0 = time.monotonic()

    def after_step(self) -> None:
        self.steps_done += 1
        if self.steps_done >= self.num_steps:
            self._nvtx.capture_stop(self.device_type)
            self.result = {
                "kind": "nsys", "steps": self.steps_done, "first_step": self._first_step,
                "last_step": self._first_step + self.steps_done,
                "wall_s": time.monotonic() - self._t0, "device": str(self.device),
                "nvtx_ranges": self._ranges, "note": NSYS_NOTE}
            self._on_done()

    def cancel(self) -> None:
        self._nvtx.capture_stop(self.device_type)


class ProfileBook:
    def __init__(self) -> None:
        self._lock = threading.RLock()      # guards everything below (re-entered: `_settle`)
        self._status: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._ids = itertools.count(1)
        self._profiler: StepProfiler | NsysCapture | None = None   # the running one
        self.active: str | None = None      # the running profile's id

    # --- busy loop ----------------------------------------------------------------------------

    def start(self, core: ServingCore, steps: int, *, nsys: bool = False) -> dict[str, Any]:
        """Arm a profile of the next ``steps`` steps (``nsys``: an `NsysCapture`); its
        status. Raises ValueError with the reason (one is running; nsys without CUDA)."""
        with self._lock:
            if self.active is not None:
                prof = self._profiler
                assert prof is not None
                what = ("building its report" if prof.reporting else
                        f"{prof.steps_done}/{prof.num_steps} steps done")
                raise ValueError(f"profile {self.active} is running ({what}); wait for it or "
                                 "cancel it")
            pid = f"p{next(self._ids)}"
            on_done = partial(self._settle, pid)
            self._profiler = (NsysCapture(core, steps, on_done) if nsys
                              else core.start_profile(steps, on_done=on_done))
            self.active = pid
            self._put(pid, {"id": pid, "state": RUNNING, "steps": steps, "steps_done": 0,
                            "profiling": True, "started_ts": time.time(), "finished_ts": None,
                            "slowdown_note": NSYS_NOTE if nsys else SLOWER, "result": None,
                            "error": None, "kind": "nsys" if nsys else "torch"})
        if nsys:
            log.warning("profile %s: nsys capture range open (cudaProfilerStart) for the next "
                        "%d steps", pid, steps)
        else:
            log.warning("profile %s: profiling the next %d steps with torch.profiler; %s", pid,
                        steps, SLOWER)
        return self.view(pid) or {}

    def after_step(self) -> None:
        """Note the running profile's progress."""
        with self._lock:
            prof, pid = self._profiler, self.active
            if prof is None or pid is None:
                return
            if isinstance(prof, NsysCapture):
                prof.after_step()             # may settle it: the lock is re-entrant
                if self.active != pid:
                    return
            if prof.steps_done != self._status[pid]["steps_done"]:
                self._status[pid] = {**self._status[pid], "steps_done": prof.steps_done}

    def cancel(self, pid: str | None, reason: str = "cancelled") -> dict[str, Any]:
        """Cancel profile ``pid`` (None: the running one, if any); its status. Raises
        ValueError for an unknown id; a finished one is returned as is."""
        with self._lock:
            if pid is not None and pid not in self._status:
                raise ValueError(f"no profile {pid!r}")
            if self.active is None or (pid is not None and pid != self.active):
                return self._status.get(pid or "", {})
            pid, prof = self.active, self._profiler
            assert prof is not None             # set whenever a profile is active
            self._finish(pid, CANCELLED, error=reason)
        prof.cancel()       # its on_done finds the profile already settled
        log.info("profile %s %s after %d steps", pid, reason, prof.steps_done)
        return self.view(pid) or {}

    # --- any thread ---------------------------------------------------------------------------

    def view(self, pid: str) -> dict[str, Any] | None:
        with self._lock:
            return self._status.get(pid)

    def _settle(self, pid: str) -> None:
        """The profiler's ``on_done`` (the report thread, or the busy loop on failure)."""
        with self._lock:
            if pid != self.active:
                return                      # cancelled meanwhile
            prof = self._profiler
            assert prof is not None
            if prof.result is not None:
                self._finish(pid, DONE, result={"id": pid, **prof.result})
            else:
                self._finish(pid, FAILED, error=prof.error or "the profiler stopped")
        if prof.result is not None and isinstance(prof, NsysCapture):
            log.info("profile %s: nsys capture range closed (cudaProfilerStop) after %d steps",
                     pid, prof.steps_done)
        elif prof.result is not None:
            r = prof.result
            log.info("profile %s done: %d steps in %.2f s (mean step %.1f ms, profiled)", pid,
                     r["steps"], r["wall_s"], r["mean_step_s"] * 1e3)
        else:
            log.error("profile %s failed: %s", pid, prof.error)

    # --- internals (under the lock) -----------------------------------------------------------

    def _put(self, pid: str, status: dict[str, Any]) -> None:
        self._status[pid] = status
        while len(self._status) > KEEP:
            self._status.popitem(last=False)

    def _finish(self, pid: str, state: str, *, result: dict[str, Any] | None = None,
                error: str | None = None) -> None:
        assert self._profiler is not None
        self._status[pid] = {**self._status[pid], "state": state,
                             "steps_done": self._profiler.steps_done, "profiling": False,
                             "finished_ts": time.time(), "result": result, "error": error}
        self._profiler = None
        self.active = None
