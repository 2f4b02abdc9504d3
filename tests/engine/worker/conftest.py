"""Fixtures shared by the worker's tests."""

from __future__ import annotations

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
