"""GPU readings through NVML (the `pynvml` module of nvidia-ml-py), as the ``gpu`` topic payload.

Why a probe object and not free functions: NVML is initialised once (``nvmlInit`` costs tens of
ms and must be paired with ``nvmlShutdown``), device handles are cached, and a failure to
initialise is remembered so a machine without a driver is not re-probed every second.

Invariant: `GpuProbe.read` never raises. Whatever goes wrong (no library, no driver, a
driver/library version mismatch, no permission, a lost GPU) becomes
``{"available": False, "devices": [], "error": "<reason a person can act on>"}``; a single
metric a device does not support is ``None`` in that device's row.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType
from typing import Any

# NVML return codes -> what to tell a person. Codes are stable across NVML versions.
_REASONS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "NVML library (libnvidia-ml.so) not found: no NVIDIA driver "
                                    "installed",
    "NVML_ERROR_DRIVER_NOT_LOADED": "NVIDIA driver not loaded",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "NVIDIA driver/library version mismatch (reboot or "
                                          "reload the kernel module after a driver update)",
    "NVML_ERROR_NO_PERMISSION": "no permission to query the GPU through NVML",
    "NVML_ERROR_GPU_IS_LOST": "the GPU has fallen off the bus or is otherwise lost",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "the installed NVML library lacks a required function "
                                     "(driver too old)",
    "NVML_ERROR_UNINITIALIZED": "NVML is not initialised",
}


def _load_nvml() -> ModuleType | str:
    try:
        import pynvml
    except ImportError as e:
        return f"pynvml not importable ({e}); install nvidia-ml-py"
    return pynvml


class GpuProbe:
    """Reads every visible NVIDIA device. Thread-safe; cheap after the first call.

    ``nvml`` replaces the `pynvml` module (tests pass a fake with the same functions)."""

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml_arg = nvml
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._error: str | None = None
        self._inited = False
        self._up = False  # nvmlInit succeeded, so nvmlShutdown is owed
        self._lock = threading.Lock()

    def _reason(self, e: BaseException) -> str:
        nv = self._nvml
        code = getattr(e, "value", None)
        if nv is not None and code is not None:
            for const, text in _REASONS.items():
                if getattr(nv, const, object()) == code:
                    return f"{text} [{e}]"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _init(self) -> None:
        self._inited = True
        mod = self._nvml_arg if self._nvml_arg is not None else _load_nvml()
        if isinstance(mod, str):
            self._error = mod
            return
        self._nvml = mod
        try:
            mod.nvmlInit()
        except Exception as e:  # NVMLError and, with a broken install, OSError and friends
            self._error = self._reason(e)
            self._nvml = None
            return
        self._up = True
        try:
            count = mod.nvmlDeviceGetCount()
            for i in range(count):
                h = mod.nvmlDeviceGetHandleByIndex(i)
                name = mod.nvmlDeviceGetName(h)
                self._handles.append(h)
                self._names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception as e:
            self._error = self._reason(e)
            self._handles, self._names = [], []
            return
        if not self._handles:
            self._error = "NVML found no NVIDIA devices"

    def _metric(self, fn: str, *args: Any) -> Any:
        """One NVML query; an unsupported (or otherwise failing) single metric is None."""
        try:
            return getattr(self._nvml, fn)(*args)
        except Exception:
            return None

    def read(self) -> dict[str, Any]:
        """The ``gpu`` payload body: ``available``, ``devices`` (rows), ``error``.

        Units: ``util`` percent (0-100), ``mem_used``/``mem_total`` bytes, ``temp_c`` degrees C,
        ``power_w`` watts, ``sm_clock_mhz`` MHz."""
        with self._lock:
            if not self._inited:
                self._init()
            if self._error is not None:
                return {"available": False, "devices": [], "error": self._error}
            nv = self._nvml
            devices = []
            for i, h in enumerate(self._handles):
                util = self._metric("nvmlDeviceGetUtilizationRates", h)
                mem = self._metric("nvmlDeviceGetMemoryInfo", h)
                power_mw = self._metric("nvmlDeviceGetPowerUsage", h)
                devices.append({
                    "index": i,
                    "name": self._names[i],
                    "util": None if util is None else float(util.gpu),
                    "mem_used": None if mem is None else int(mem.used),
                    "mem_total": None if mem is None else int(mem.total),
                    "temp_c": self._metric("nvmlDeviceGetTemperature", h,
                                           getattr(nv, "NVML_TEMPERATURE_GPU", 0)),
                    "power_w": None if power_mw is None else power_mw / 1000.0,
                    "sm_clock_mhz": self._metric("nvmlDeviceGetClockInfo", h,
                                                 getattr(nv, "NVML_CLOCK_SM", 1)),
                })
            return {"available": True, "devices": devices, "error": None}

    def close(self) -> None:
        with self._lock:
            if self._up:
                with contextlib.suppress(Exception):
                    self._nvml.nvmlShutdown()
            self._nvml, self._handles, self._names = None, [], []
            self._inited, self._up, self._error = False, False, None


def memory_share(gpu: dict[str, Any]) -> float | None:
    """Highest used/total memory share over the devices of a ``gpu`` payload (None if unknown);
    what the gpu_memory alert watches."""
    shares = [d["mem_used"] / d["mem_total"] for d in gpu.get("devices", ())
              if d.get("mem_used") is not None and d.get("mem_total")]
    return max(shares) if shares else None
