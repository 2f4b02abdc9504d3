"""Whether this machine can build the CPU attention kernel (a C++ compiler on PATH)."""

from __future__ import annotations

import shutil

HAVE_CXX = shutil.which("c++") is not None or shutil.which("g++") is not None
