"""The CPU decode-attention kernel (`csrc/paged_attention.cpp`): built, cached and loaded here.

The kernel reads each decode row's K/V through its block table where they lie in the pool,
instead of gathering the blocks into a copy and reading the copy again in SDPA (the pure-torch
path in `paged_attention`, which stays the fallback and the reference). It is built with
``torch.utils.cpp_extension`` (a C++ compiler and ninja) for this machine's CPU, once: ``make
install`` runs ``python -m vconsole.engine.worker.attention_kernel`` after installing the
package, and the engine builds it on first use if that did not happen (~20 s). The build lands
where torch keeps JIT extensions (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)
under a name tagged with a hash of the source, the torch and Python versions and the CPU, so a new
torch or another machine builds afresh.

``VCONSOLE_ATTENTION_KERNEL=torch`` keeps the pure-torch path (the benchmarks' before/after);
a build that fails (no compiler) is logged once and the engine runs the torch path.

Used for float32 pools on the CPU only; CUDA and other dtypes take the torch path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

KERNEL_ENV = "VCONSOLE_ATTENTION_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, Any] = {}   # "module" (or None) and "reason", once tried


def _cpu_tag() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def build_tag() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode(),
                 _cpu_tag().encode(), sys.version.encode()):
        h.update(part)
    return h.hexdigest()[:12]


def module_name() -> str:
    return f"vconsole_paged_attention_{build_tag()}"


def build_dir() -> Path:
    """torch's own folder for JIT extensions (``$TORCH_EXTENSIONS_DIR``, default
    ``~/.cache/torch_extensions``), one subfolder per build tag."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(module_name(), verbose=False))


def is_built() -> bool:
    """Whether a build for this source, torch and CPU is in the cache (loading it is quick)."""
    return any(build_dir().glob("*.so"))


def wanted() -> bool:
    return os.environ.get(KERNEL_ENV, "auto") != "torch"


def load() -> Any | None:
    """The compiled module (``paged_decode_attention``), or None when it is not wanted or
    cannot be built (``reason()`` says why). Builds on the first call if need be; thread-safe,
    tried once per process."""
    with _lock:
        if "reason" in _state:
            return _state["module"]
        module, reason = None, "not wanted (VCONSOLE_ATTENTION_KERNEL=torch)"
        if wanted():
            try:
                module, reason = _build(), "built"
            except Exception as e:  # no compiler, no ninja, a header mismatch: use torch
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
                log.warning("the CPU attention kernel is unavailable (%s); using the torch "
                            "path", reason)
        _state.update(module=module, reason=reason)
        return module


def reason() -> str:
    return _state.get("reason", "not tried")


def _build() -> Any:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # Built from a copy inside the build folder: ninja rebuilds when a source's *path* changes,
    # and two checkouts of the project (a clone for CI beside a work tree) would otherwise take
    # turns rebuilding the same tag, 20 s each, while engines wait for the lock.
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / SOURCE.name
    code = SOURCE.read_bytes()
    if not source.is_file() or source.read_bytes() != code:
        tmp = source.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(code)
        os.replace(tmp, source)
    return cpp_extension.load(name=module_name(), sources=[str(source)], extra_cflags=CFLAGS,
                              extra_ldflags=["-fopenmp"], verbose=False)


def main() -> int:
    """Build (or find) the kernel and print one JSON line; exit 0 either way (the engine
    falls back to torch), so an install never fails for want of a compiler."""
    module = load()
    print(json.dumps({"attention_kernel": "ready" if module is not None else "unavailable",
                      "reason": reason(), "dir": str(build_dir())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
