"""The CPU decode-attention kernel (`csrc/`): built, cached and loaded here.

The kernel reads each decode row's K/V through its block table where they lie in the pool,
instead of gathering the blocks into a copy and reading the copy again in SDPA (the pure-torch
path in `paged_attention`, which stays the fallback and the reference). ``make install`` runs
``python -m vconsole.engine.worker.attention_kernel`` after installing the package; the engine
builds it on its first start if that did not happen.

**A fast build.** The sources are torch operators (``ops.cpp``: the tensor checks, registered
with ``TORCH_LIBRARY``) over plain C++ kernels, one translation unit per way of storing K/V
(``attend_*.cpp``), which include ATen's ``parallel_for`` and c10's ``Half`` only. This module
runs one compiler per core, then links; a line says when the build starts and how long it
should take, another every ``HEARTBEAT_S`` how far it is. Compiled for this CPU
(``-march=native``): the AVX-512 path where the CPU has it, else the generic vector path (AVX2,
NEON). Measured on a 2-core machine: the README's Start section.

**One build per source.** The build lands in the project's own cache,
``$VCONSOLE_CACHE/kernels/paged_attention-<tag>/`` (default ``~/.cache/vconsole``), where the
tag hashes what decides the machine code: the sources, the compiler flags, the compiler named
by ``$CXX``, the torch version and ABI, and the CPU. An entry is complete once its
``manifest.json`` names the shared library beside it; a later start loads that file with
``torch.ops.load_library`` and never compiles. The operators' namespace carries the tag, so two
builds (the tests' other vector paths) load side by side in one process.

**Concurrent starts.** Builders of one tag take an exclusive ``flock`` on the entry's ``lock``
file (the kernel drops it when a builder dies, so a killed build never wedges the next), compile
in a private temporary folder, and publish with ``os.replace``: first the library, then the
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
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vconsole.engine.kernel_cache import (  # noqa: F401  (re-exported: one place to ask)
    BUILDING,
    COMPILING,
    ENTRY_PREFIX,
    EXPECTED_BUILD,
    build_in_progress,
    cache_root,
)
from vconsole.engine.worker import file_lock

log = logging.getLogger(__name__)

KERNEL_ENV = "VCONSOLE_ATTENTION_KERNEL"
CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
# A file's own flags, after CFLAGS and the caller's: the native decode step is the Python path's
# bit for bit only with IEEE operations (no fast math, no fused multiply-adds; it refuses to
# compile with fast math).
FILE_CFLAGS = {"decode_step.cpp": ["-fno-fast-math", "-ffp-contract=off"]}
LDFLAGS = ["-fopenmp"]
MANIFEST = "manifest.json"
LOCK = "lock"
HEARTBEAT_S = 10.0
OPS = ("paged_decode_attention", "paged_decode_attention_quant", "paged_decode_attention_kivi",
       "quantize_store", "int8_gemm", "int8_gemm_isa", "gguf_linear", "gguf_dequantize")
_FORMAT = 2   # bump when the cache entry's layout changes (2: a torch.ops library)

_lock = threading.Lock()
_state: dict[tuple[str, ...], tuple[Any, str]] = {}   # extra flags -> (kernel or None, reason)


@dataclass(frozen=True)
class Kernel:
    """The loaded operators (``torch.ops.<namespace>.<name>.default``), called as the
    attention and `kv_quant` call them."""

    namespace: str
    library: Path
    paged_decode_attention: Callable[..., None]
    paged_decode_attention_quant: Callable[..., None]
    paged_decode_attention_kivi: Callable[..., None]
    quantize_store: Callable[..., None]
    int8_gemm: Callable[..., None]        # the int8 weights' many-rows GEMM (csrc/int8_gemm.cpp)
    int8_gemm_isa: Callable[[], str]      # its vector path: avx512, avx2 or generic
    gguf_linear: Callable[..., None]      # GGUF quantized weights' linear (csrc/gguf_gemm.cpp)
    gguf_dequantize: Callable[..., None]  # those weights as float32 (the same decoding)


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


def sources() -> list[Path]:
    """The translation units, the torch operators first (the longest to compile)."""
    return sorted(CSRC.glob("*.cpp"), key=lambda p: (p.name != "ops.cpp", p.name))


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def build_inputs(extra: Sequence[str] = ()) -> dict[str, str]:
    """Everything the built code depends on, by name (hashed into the tag; kept in the
    manifest so a person can see why two entries differ). ``extra``: compiler flags after
    ``CFLAGS`` (the tests build the other vector paths with ``-mno-avx512f``)."""
    import torch

    own = "; ".join(f"{name}: {' '.join(flags)}" for name, flags in sorted(FILE_CFLAGS.items()))
    return {"source": _source_hash(), "cflags": " ".join([*CFLAGS, *extra]), "file_cflags": own,
            "ldflags": " ".join(LDFLAGS), "cxx": _cxx(), "torch": torch.__version__,
            "abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
            "cpu": hashlib.sha256(_cpu_tag().encode()).hexdigest()[:16],
            "format": str(_FORMAT)}


def build_tag(extra: Sequence[str] = ()) -> str:
    return hashlib.sha256(json.dumps(build_inputs(extra), sort_keys=True).encode()
                          ).hexdigest()[:16]


def build_dir(extra: Sequence[str] = ()) -> Path:
    """This source's cache entry (it may not exist yet)."""
    return cache_root() / f"{ENTRY_PREFIX}{build_tag(extra)}"


def _manifest(entry: Path) -> dict[str, Any] | None:
    """The entry's manifest when the entry is complete (its library is there)."""
    try:
        record = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("namespace"), str) \
            or not isinstance(record.get("library"), str):
        return None
    return record if (entry / record["library"]).is_file() else None


def is_built() -> bool:
    """Whether a complete build for this source, torch and CPU is in the cache."""
    return _manifest(build_dir()) is not None


def wanted() -> bool:
    return os.environ.get(KERNEL_ENV, "auto") != "torch"


def load() -> Kernel | None:
    """The engine's kernel, or None when it is not wanted or cannot be built (``reason()``
    says why). Loads the cached build, or builds it first; thread-safe, tried once per
    process."""
    if not wanted():
        with _lock:
            return _state.setdefault((), (None, "not wanted (VCONSOLE_ATTENTION_KERNEL=torch)"))[0]
    try:
        return build()
    except Exception:   # logged by `build`; the engine runs the torch path
        return None


def build(extra: Sequence[str] = ()) -> Kernel:
    """The kernel compiled with ``CFLAGS`` and ``extra``: loaded from the cache, or built into
    it first. Tried once per process and flags; raises (and logs once) when it cannot be
    built: no compiler, a header mismatch."""
    key = tuple(extra)
    with _lock:
        if key not in _state:
            try:
                _state[key] = _load_or_build(list(extra))
            except Exception as e:
                text = str(e).strip()
                if "\n" in text:           # a compiler's output: all of it, then its gist
                    log.info("%s", text)
                why = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
                log.warning("the CPU attention kernel is unavailable (%s); using the torch "
                            "path", why)
                _state[key] = (None, why)
        kernel, why = _state[key]
    if kernel is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {why}")
    return kernel


def reason() -> str:
    """How `load` ended: ``loaded`` (from the cache), ``built`` (compiled by this process),
    why not, or ``not tried``."""
    return _state[()][1] if () in _state else "not tried"


def _load_or_build(extra: list[str]) -> tuple[Kernel, str]:
    entry = build_dir(extra)
    found = _manifest(entry)
    if found is not None:
        return _load(entry, found), "loaded"
    entry.mkdir(parents=True, exist_ok=True)
    with _entry_lock(entry):
        found = _manifest(entry)          # built by another process while this one waited
        if found is not None:
            log.info("the attention kernel was compiled by another process; loaded from %s",
                     entry)
            return _load(entry, found), "loaded"
        return _build_into(entry, extra), "built"


def _entry_lock(entry: Path) -> contextlib.AbstractContextManager[None]:
    """The entry's exclusive build lock; says so in the log when another builder has it."""
    def waiting() -> None:
        other = build_in_progress(entry.parent)
        who = f"pid {other['pid']}" if other else "another process"
        log.warning("%s: waiting for %s, which is compiling it into %s", COMPILING, who, entry)

    return file_lock.exclusive(entry / LOCK, waiting)


def _load(entry: Path, manifest: dict[str, Any]) -> Kernel:
    """Load the cached library (its static initialisers register the operators) and look
    the operators up."""
    import torch

    library = entry / manifest["library"]
    torch.ops.load_library(str(library))
    ns = getattr(torch.ops, manifest["namespace"])
    return Kernel(manifest["namespace"], library,
                  **{name: getattr(ns, name).default for name in OPS})


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _jobs(files: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(files, cores))


def _expected(root: Path, jobs: int) -> str:
    """What to tell the user the build will take: the last build in this cache (CPU seconds
    over the cores it gets now), else the figure measured on a 2-core machine."""
    last: tuple[float, float] | None = None
    for manifest in root.glob(f"{ENTRY_PREFIX}*/{MANIFEST}"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            record = json.loads(manifest.read_text())
            if last is None or record["built"] > last[0]:
                last = (float(record["built"]), float(record["cpu_seconds"]))
    if last is None:
        return EXPECTED_BUILD
    return f"about {max(1, round(last[1] / jobs))} s (the last build here: {last[1]:.0f} s of CPU)"


def _build_into(entry: Path, extra: list[str]) -> Kernel:
    """Compile in a private folder under the entry (the lock is held), then publish the
    library and, last, the manifest, each with one rename."""
    import torch
    from torch.utils import cpp_extension

    cxx = shlex.split(_cxx()) or ["c++"]     # $CXX may carry a launcher: "ccache g++"
    if shutil.which(cxx[0]) is None:
        raise RuntimeError(f"no C++ compiler ({_cxx()}) on PATH")
    inputs = build_inputs(extra)
    namespace = f"vconsole_{build_tag(extra)}"
    files = sources()
    jobs = _jobs(len(files))
    started = time.time()
    marker = entry / BUILDING
    _write_json(marker, {"pid": os.getpid(), "since": started})
    log.warning("%s: %d files, %d at a time, %s: into %s", COMPILING, len(files), jobs,
                _expected(entry.parent, jobs), entry)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=entry))
    try:
        flags = [*CFLAGS, *extra, f"-D_GLIBCXX_USE_CXX11_ABI={inputs['abi']}",
                 f"-DVC_OPS={namespace}", f"-I{CSRC}",
                 *(f"-isystem{p}" for p in cpp_extension.include_paths("cpu"))]
        objects = [work / f"{src.stem}.o" for src in files]
        commands = {f"compiling {src.name}": [*cxx, *flags, *FILE_CFLAGS.get(src.name, ()),
                                              "-c", str(src), "-o", str(obj)]
                    for src, obj in zip(files, objects, strict=True)}
        library = f"{namespace}.so"
        link = [*cxx, "-shared", *map(str, objects), *LDFLAGS,
                f"-L{cpp_extension.TORCH_LIB_PATH}", "-lc10", "-ltorch_cpu",
                "-o", str(work / library)]
        cpu = (_run_all(commands, jobs, work, started)
               + _run_all({f"linking {library}": link}, 1, work, started))
        seconds = time.time() - started
        tmp = entry / f".{library}.{os.getpid()}"
        shutil.copyfile(work / library, tmp)
        os.replace(tmp, entry / library)
        manifest = {"namespace": namespace, "library": library, "built": started,
                    "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "jobs": jobs,
                    "torch": torch.__version__, "inputs": inputs}
        _write_json(entry / MANIFEST, manifest)
        log.info("the attention kernel compiled in %.1f s (%.1f s of CPU, %d at a time): %s",
                 seconds, cpu, jobs, entry / library)
        return _load(entry, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()


def _run_all(commands: dict[str, list[str]], jobs: int, work: Path, started: float) -> float:
    """Run the compiler ``commands`` (by what each does), ``jobs`` at a time, saying every
    ``HEARTBEAT_S`` how many are done; their CPU seconds (user + system, from each child's
    rusage). Raises with the compiler's output when one fails (the others are stopped), its
    first error last: the line `load` logs."""
    waiting = list(enumerate(commands.items()))
    running: dict[int, tuple[str, subprocess.Popen[bytes], Path]] = {}
    done, cpu = 0, 0.0
    next_beat = time.monotonic() + HEARTBEAT_S
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i, (what, cmd) = waiting.pop(0)
                err = work / f"{i}.err"
                with open(err, "wb") as f:
                    running[i] = (what, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT),
                                  err)
            for i, (what, proc, err) in list(running.items()):
                try:
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                except ChildProcessError:   # reaped by someone else: its output files tell
                    proc.returncode = 0
                else:
                    if pid == 0:
                        continue
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    cpu += usage.ru_utime + usage.ru_stime
                del running[i]
                if proc.returncode != 0:
                    output = err.read_text(errors="replace").strip()
                    first = next((line for line in output.splitlines() if "error" in line),
                                 f"exit status {proc.returncode}")
                    raise RuntimeError(f"{what} failed:\n{output[-3000:]}\n{what} failed: {first}")
                done += 1
            if time.monotonic() >= next_beat and len(commands) > 1:
                log.info("compiling the attention kernel: %d of %d files done, %.0f s so far",
                         done, len(commands), time.time() - started)
                next_beat += HEARTBEAT_S
            time.sleep(0.05)
    finally:
        for _, proc, _ in running.values():
            proc.kill()
            proc.wait()
    return cpu


def main() -> int:
    """Build (or find) the kernel and print one JSON line; exit 0 either way (the engine
    falls back to torch), so an install never fails for want of a compiler."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    kernel = load()
    print(json.dumps({"attention_kernel": "ready" if kernel is not None else "unavailable",
                      "reason": reason(), "dir": str(build_dir())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
