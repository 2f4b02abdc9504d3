"""Fixtures shared by the worker's tests."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from tests.support.cxx import HAVE_CXX
from vconsole.engine.worker import attention_kernel


@pytest.fixture(scope="module")
def kernel():
    """The compiled CPU attention module (built on first use); skipped without a compiler."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the engine runs the torch path")
    module = attention_kernel.load()
    assert module is not None, f"the kernel did not build: {attention_kernel.reason()}"
    return module


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# The kernel's vector paths (csrc/attend_impl.h picks one at compile time), each as the flags
# that make this CPU's build take it, and the CPU flag without which it is the native build
# already: AVX-512; the generic vectors with F16C's float16 loads (what an AVX2 machine runs);
# the generic vectors converting float16 one value at a time (ARM, x86 before F16C).
VECTOR_PATHS = {"native": ((), None),
                "no-avx512": (("-mno-avx512f",), "avx512f"),
                "no-f16c": (("-mno-avx512f", "-mno-f16c"), "f16c")}


@pytest.fixture(scope="module", params=list(VECTOR_PATHS))
def each_kernel(request):
    """The kernel built for each vector path this CPU can run (each build once per source
    into the kernel cache, ~15 s of CPU); a path this CPU's native build already takes is
    skipped."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the engine runs the torch path")
    extra, needs = VECTOR_PATHS[request.param]
    if needs is not None and (platform.machine() != "x86_64" or needs not in _cpu_flags()):
        pytest.skip(f"the native build takes this path here (no {needs})")
    return attention_kernel.build(extra)


# The GGUF kernels' vector paths (csrc/gguf_gemm.cpp), each as the extra flags that make this
# CPU's build take it, and the CPU flag without which the native build takes it already.
GGUF_PATHS = {"native": ((), None), "avx2": (("-mno-avx512f",), "avx512f"),
              "generic": (("-mno-avx2",), "avx2")}


@pytest.fixture(scope="module", params=list(GGUF_PATHS))
def path_kernel(request):
    """The GGUF kernels of each vector path this CPU can run, in use for the module's tests
    (`gguf_linear.use_kernel`); a path the native build takes already is skipped."""
    from vconsole.engine.worker import gguf_linear

    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the gguf kernels are not available")
    extra, needs = GGUF_PATHS[request.param]
    if needs is not None and (platform.machine() != "x86_64" or needs not in _cpu_flags()):
        pytest.skip(f"the native build takes this path here (no {needs})")
    kernel = attention_kernel.build(extra)
    gguf_linear.use_kernel(kernel)
    yield request.param, kernel
    gguf_linear.use_kernel(None)
