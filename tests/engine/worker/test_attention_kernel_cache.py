"""The CPU attention kernel is compiled once per source into vconsole's own cache and loaded from
there whichever ``ninja`` is on PATH (the venv's and the system's wrote different command
hashes: torch's JIT loader rebuilt at every switch, 30-40 s of a silent engine start); two
builders at once leave one complete entry; a build under way is visible to whoever waits, and
says from its start how long it should take and every few seconds how far it is."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cxx import HAVE_CXX
from vconsole.engine.kernel_cache import KERNEL_CACHE_ENV
from vconsole.engine.worker import attention_kernel

needs_compiler = pytest.mark.skipif(not HAVE_CXX,
                                    reason="no C++ compiler: the engine runs the torch path")


# A stand-in for the kernel's sources: the same operators, declared without code, and a second
# translation unit, so that a build takes seconds of CPU (torch's operator headers) instead of the
# kernels' own compile. The cache's rules do not depend on what is compiled.
STAND_IN = {
    "ops.cpp": """
#include <torch/library.h>
#define VC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
VC_LIBRARY(VC_OPS, m) {
  m.def("paged_decode_attention() -> ()");
  m.def("paged_decode_attention_quant() -> ()");
  m.def("paged_decode_attention_kivi() -> ()");
  m.def("quantize_store() -> ()");
  m.def("int8_gemm() -> ()");
  m.def("int8_gemm_isa() -> ()");
  m.def("gguf_linear() -> ()");
  m.def("gguf_dequantize() -> ()");
}
""",
    "attend_stand_in.cpp": "int vc_stand_in() { return 0; }\n",
}
RUN_WITH_SOURCES = ("import sys; from pathlib import Path; "
                    "import vconsole.engine.worker.attention_kernel as k; "
                    "k.CSRC = Path(sys.argv[1]); k.HEARTBEAT_S = float(sys.argv[2]); "
                    "raise SystemExit(k.main())")


def _kernel_cmd(cache: Path, path_prefix: Path | None = None, heartbeat_s: float = 10.0
                ) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "VCONSOLE_CACHE": str(cache)}
    env.pop(attention_kernel.KERNEL_ENV, None)
    env.pop(KERNEL_CACHE_ENV, None)            # this test's own kernel cache, not the suite's
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
    csrc = cache.parent / "stand_in"
    if not csrc.exists():
        csrc.mkdir()
        for name, text in STAND_IN.items():
            (csrc / name).write_text(text)
    return [sys.executable, "-c", RUN_WITH_SOURCES, str(csrc), str(heartbeat_s)], env


def _fake_ninja(folder: Path) -> Path:
    """A ``ninja`` that records each call and fails: any use of it is a rebuild attempt."""
    folder.mkdir()
    calls = folder / "calls"
    script = folder / "ninja"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    script.chmod(0o755)
    return calls


@needs_compiler
@pytest.mark.slow
def test_two_builders_leave_one_build_which_loads_with_another_ninja_first_on_path(tmp_path):
    cache = tmp_path / "cache"
    cmd, env = _kernel_cmd(cache)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    seen_building: set[int] = set()
    while any(p.poll() is None for p in procs):       # the stand-in builds in seconds
        found = attention_kernel.build_in_progress(cache / "kernels")
        if found is not None:
            seen_building.add(found["pid"])
        time.sleep(0.2)
    results = []
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        results.append((json.loads(out.splitlines()[-1]), err))
    assert sorted(r["reason"] for r, _ in results) == ["built", "loaded"], results
    assert all(r["attention_kernel"] == "ready" for r, _ in results)
    builder = next(p.pid for p, (r, _) in zip(procs, results, strict=True) if r["reason"] == "built")
    assert seen_building == {builder}      # the marker named the builder while it ran
    assert any(attention_kernel.COMPILING in err for _, err in results)
    entries = list((cache / "kernels").iterdir())
    assert len(entries) == 1 and (entries[0] / attention_kernel.MANIFEST).is_file()
    assert not list(entries[0].glob(".build-*"))               # the work folder is gone
    assert attention_kernel.build_in_progress(cache / "kernels") is None

    calls = _fake_ninja(tmp_path / "other-ninja")
    cmd, env = _kernel_cmd(cache, path_prefix=tmp_path / "other-ninja")
    assert shutil.which("ninja", path=env["PATH"]) == str(tmp_path / "other-ninja" / "ninja")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    record = json.loads(again.stdout.splitlines()[-1])
    assert record == {"attention_kernel": "ready", "reason": "loaded", "dir": str(entries[0])}
    assert not calls.exists(), f"ninja was run: {calls.read_text()}"
    assert attention_kernel.COMPILING not in again.stderr


@needs_compiler
@pytest.mark.slow
def test_a_build_says_how_long_it_should_take_and_how_far_it_is(tmp_path):
    """The first build quotes the figure measured on a 2-core machine; a later one (another
    source) what the last build here cost; while the files compile, a line per heartbeat."""
    cache = tmp_path / "cache"
    cmd, env = _kernel_cmd(cache, heartbeat_s=0.2)
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    jobs = min(2, len(os.sched_getaffinity(0)))
    assert (f"{attention_kernel.COMPILING}: 2 files, {jobs} at a time, "
            f"{attention_kernel.EXPECTED_BUILD}: into ") in first.stderr
    assert re.search(r"compiling the attention kernel: [01] of 2 files done, \d+ s so far",
                     first.stderr), first.stderr
    manifest = json.loads(next((cache / "kernels").glob("*/manifest.json")).read_text())
    assert manifest["jobs"] == jobs and manifest["cpu_seconds"] > 0
    assert re.search(rf"compiled in [\d.]+ s \([\d.]+ s of CPU, {jobs} at a time\)",
                     first.stderr)

    (tmp_path / "stand_in" / "attend_stand_in.cpp").write_text("int vc_other() { return 1; }\n")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.splitlines()[-1])["reason"] == "built"
    expected = max(1, round(manifest["cpu_seconds"] / jobs))
    assert (f"about {expected} s (the last build here: {manifest['cpu_seconds']:.0f} s of CPU)"
            in second.stderr), second.stderr


@needs_compiler
def test_a_source_that_does_not_compile_is_named_and_the_engine_keeps_the_torch_path(tmp_path):
    cache = tmp_path / "cache"
    cmd, env = _kernel_cmd(cache)
    (tmp_path / "stand_in" / "attend_stand_in.cpp").write_text("int vc_stand_in() { return; }\n")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr            # an install goes on without the kernel
    record = json.loads(run.stdout.splitlines()[-1])
    assert record["attention_kernel"] == "unavailable"
    assert record["reason"].startswith("RuntimeError: compiling attend_stand_in.cpp failed: ")
    assert "error" in record["reason"] and "return" in run.stderr   # the compiler's own words
    assert not (Path(record["dir"]) / attention_kernel.MANIFEST).exists()
    assert attention_kernel.build_in_progress(cache / "kernels") is None


def test_a_marker_left_by_a_dead_builder_is_not_a_build_in_progress(tmp_path):
    entry = tmp_path / f"{attention_kernel.ENTRY_PREFIX}0123"
    entry.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (entry / attention_kernel.BUILDING).write_text(json.dumps({"pid": dead.pid, "since": 1.0}))
    assert attention_kernel.build_in_progress(tmp_path) is None
    (entry / attention_kernel.BUILDING).write_text(json.dumps({"pid": os.getpid(), "since": 1.0}))
    found = attention_kernel.build_in_progress(tmp_path)
    assert found is not None and found["pid"] == os.getpid() and found["entry"] == str(entry)


def test_an_entry_is_complete_only_once_its_manifest_names_a_library_that_is_there(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)
    entry = attention_kernel.build_dir()
    assert entry.parent == tmp_path / "kernels" and not attention_kernel.is_built()
    entry.mkdir(parents=True)
    (entry / attention_kernel.MANIFEST).write_text(json.dumps({"namespace": "m",
                                                                "library": "m.so"}))
    assert not attention_kernel.is_built()      # a manifest without its library: not built
    (entry / "m.so").write_bytes(b"")
    assert attention_kernel.is_built()


def test_the_tag_changes_with_what_decides_the_code_and_not_with_ninja(monkeypatch):
    tag = attention_kernel.build_tag()
    monkeypatch.setenv("PATH", "/nonexistent")
    assert attention_kernel.build_tag() == tag
    monkeypatch.setattr(attention_kernel, "CFLAGS", [*attention_kernel.CFLAGS, "-DX"])
    assert attention_kernel.build_tag() != tag
    assert attention_kernel.build_tag(["-mno-avx512f"]) != attention_kernel.build_tag()
