"""Host readings through psutil, as the ``host`` topic payload: the engine process and the machine.

Why a probe object: psutil's ``cpu_percent`` measures between two calls, so a fresh call is 0.0
by construction. The probe primes both counters when it is created, and every `read` then
reports the share since the previous one (about a second apart when the publisher drives it).

Invariant: `HostProbe.read` never raises; a figure psutil cannot get (process gone, access
denied) is ``None``.
"""

from __future__ import annotations

import os
from typing import Any

import psutil


class HostProbe:
    """``pid`` defaults to this process (the engine runs the publisher in-process)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._proc: psutil.Process | None
        try:
            self._proc = psutil.Process(self.pid)
            self._proc.cpu_percent(None)
        except (psutil.Error, OSError):
            self._proc = None
        psutil.cpu_percent(None)

    def read(self) -> dict[str, Any]:
        """``proc_*``: the engine process (cpu percent of one core, so >100 with threads;
        rss bytes; threads). ``sys_*``: the machine (cpu percent of all cores, memory bytes)."""
        out: dict[str, Any] = {"pid": self.pid, "proc_cpu_percent": None, "proc_rss_bytes": None,
                               "proc_num_threads": None}
        if self._proc is not None:
            try:
                with self._proc.oneshot():
                    out["proc_cpu_percent"] = self._proc.cpu_percent(None)
                    out["proc_rss_bytes"] = self._proc.memory_info().rss
                    out["proc_num_threads"] = self._proc.num_threads()
            except (psutil.Error, OSError):
                pass
        try:
            vm = psutil.virtual_memory()
            out.update(sys_cpu_percent=psutil.cpu_percent(None), sys_cpu_count=psutil.cpu_count(),
                       sys_mem_used=vm.total - vm.available, sys_mem_total=vm.total,
                       sys_mem_available=vm.available)
        except (psutil.Error, OSError):
            out.update(sys_cpu_percent=None, sys_cpu_count=None, sys_mem_used=None,
                       sys_mem_total=None, sys_mem_available=None)
        return out
