"""The CPU decode-attention kernel (`csrc/paged_attention.cpp`): built, cached and loaded here.

The kernel reads each decode row's K/V through its block table where they lie in the pool,
instead of gathering the blocks into a copy and reading the copy again in SDPA (the pure-torch
path in `paged_attention`, which stays the fallback and the reference). ``make install`` runs
``python -m vconsole.engine.worker.attention_kernel`` after installing the package; the engine
builds it on its first start if that did not happen (20-40 s).

**One build per source.** The build lands in the project's own cache,
``$VCONSOLE_CACHE/kernels/paged_attention-<tag>/`` (default ``~/.cache/vconsole``), where the
tag hashes what decides the machine code: the source, the compiler flags, the compiler named by
``$CXX``, the torch version, the Python ABI and the CPU. An entry is complete once its
``manifest.json`` names the shared object beside it; a later start imports that file directly
and never asks torch's JIT loader (which lets ``ninja`` decide whether to rebuild: two ninja
versions on PATH, the venv's and the system's, write different command hashes, and every
switch between them cost a 30-40 s rebuild). ninja and a compiler are needed only to build.

**Concurrent starts.** Builders of one tag take an exclusive ``flock`` on the entry's ``lock``
file (the kernel drops it when a builder dies, so a killed build never wedges the next), compile
in a private temporary folder, and publish with ``os.replace``: first the ``.so``, then the
manifest. A second engine starting meanwhile waits on the lock, then finds the manifest and
loads. While a build runs, ``building.json`` in the entry names its pid; `build_in_progress`
reads it without importing torch, so a launcher waiting for its engine can say why it waits.

``VCONSOLE_ATTENTION_KERNEL=torch`` keeps the pure-torch path (the benchmarks' before/after);
a build that fails (no compiler) is logged once and the engine runs the torch path.

Used for float32 pools on the CPU only; CUDA and other dtypes take the torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vconsole.engine.kernel_cache import (  # noqa: F401  (re-exported: one place to ask)
    BUILDING,
    COMPILING,
    ENTRY_PREFIX,
    build_in_progress,
    cache_root,
)
from vconsole.engine.worker import file_lock

log = logging.getLogger(__name__)

KERNEL_ENV = "VCONSOLE_ATTENTION_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
MANIFEST = "manifest.json"
LOCK = "lock"
_FORMAT = 1   # bump when the cache entry's layout changes

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


def build_inputs() -> dict[str, str]:
    """Everything the built code depends on, by name (hashed into the tag; kept in the
    manifest so a person can see why two entries differ). Never which ninja runs."""
    import torch

    return {"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
            "cflags": " ".join(CFLAGS), "ldflags": " ".join(LDFLAGS),
            "cxx": os.environ.get("CXX", "c++"), "torch": torch.__version__,
            "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
            "cpu": hashlib.sha256(_cpu_tag().encode()).hexdigest()[:16],
            "format": str(_FORMAT)}


def build_tag() -> str:
    return hashlib.sha256(json.dumps(build_inputs(), sort_keys=True).encode()).hexdigest()[:16]


def module_name() -> str:
    return f"vconsole_paged_attention_{build_tag()}"


def build_dir() -> Path:
    """This source's cache entry (it may not exist yet)."""
    return cache_root() / f"{ENTRY_PREFIX}{build_tag()}"


def _manifest(entry: Path) -> dict[str, Any] | None:
    """The entry's manifest when the entry is complete (its shared object is there)."""
    try:
        record = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("module"), str) \
            or not isinstance(record.get("library"), str):
        return None
    return record if (entry / record["library"]).is_file() else None


def is_built() -> bool:
    """Whether a complete build for this source, torch and CPU is in the cache."""
    return _manifest(build_dir()) is not None


def wanted() -> bool:
    return os.environ.get(KERNEL_ENV, "auto") != "torch"


def load() -> Any | None:
    """The compiled module (``paged_decode_attention``), or None when it is not wanted or
    cannot be built (``reason()`` says why). Loads the cached build, or builds it first;
    thread-safe, tried once per process."""
    with _lock:
        if "reason" in _state:
            return _state["module"]
        module, reason = None, "not wanted (VCONSOLE_ATTENTION_KERNEL=torch)"
        if wanted():
            try:
                module, reason = _load_or_build()
            except Exception as e:  # no compiler, no ninja, a header mismatch: use torch
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
                log.warning("the CPU attention kernel is unavailable (%s); using the torch "
                            "path", reason)
        _state.update(module=module, reason=reason)
        return module


def reason() -> str:
    """How `load` ended: ``loaded`` (from the cache), ``built`` (compiled by this process),
    why not, or ``not tried``."""
    return _state.get("reason", "not tried")


def _load_or_build() -> tuple[Any, str]:
    entry = build_dir()
    found = _manifest(entry)
    if found is not None:
        return _import(entry, found), "loaded"
    entry.mkdir(parents=True, exist_ok=True)
    with _entry_lock(entry):
        found = _manifest(entry)          # built by another process while this one waited
        if found is not None:
            log.info("the attention kernel was compiled by another process; loaded from %s",
                     entry)
            return _import(entry, found), "loaded"
        return _build_into(entry), "built"


def _entry_lock(entry: Path) -> contextlib.AbstractContextManager[None]:
    """The entry's exclusive build lock; says so in the log when another builder has it."""
    def waiting() -> None:
        other = build_in_progress(entry.parent)
        who = f"pid {other['pid']}" if other else "another process"
        log.warning("%s: waiting for %s, which is compiling it into %s", COMPILING, who, entry)

    return file_lock.exclusive(entry / LOCK, waiting)


def _import(entry: Path, manifest: dict[str, Any]) -> Any:
    """Import the cached shared object as the module it was built as (its ``PyInit_`` name)."""
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    name = manifest["module"]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, entry / manifest["library"])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {entry / manifest['library']}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _build_into(entry: Path) -> Any:
    """Compile in a private folder under the entry (the lock is held), then publish the
    shared object and, last, the manifest, each with one rename."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    inputs = build_inputs()
    started = time.time()
    marker = entry / BUILDING
    _write_json(marker, {"pid": os.getpid(), "since": started})
    log.warning("%s, about 20-40 s: into %s", COMPILING, entry)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=entry))
    try:
        source = work / SOURCE.name
        shutil.copyfile(SOURCE, source)
        # Copies of the flags: torch appends its own link flags to the list it is given.
        module = cpp_extension.load(name=module_name(), sources=[str(source)],
                                    extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                    build_directory=str(work), verbose=False)
        built = Path(module.__file__)
        library = f"{module.__name__}{built.suffix}"   # the name torch chose (``_v1`` in-process)
        tmp = entry / f".{library}.{os.getpid()}"
        shutil.copyfile(built, tmp)
        os.replace(tmp, entry / library)
        _write_json(entry / MANIFEST, {"module": module.__name__, "library": library,
                                       "built": started, "seconds": round(time.time() - started, 1),
                                       "inputs": inputs})
        log.info("the attention kernel compiled in %.1f s: %s", time.time() - started,
                    entry / library)
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()


def main() -> int:
    """Build (or find) the kernel and print one JSON line; exit 0 either way (the engine
    falls back to torch), so an install never fails for want of a compiler."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    module = load()
    print(json.dumps({"attention_kernel": "ready" if module is not None else "unavailable",
                      "reason": reason(), "dir": str(build_dir())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
