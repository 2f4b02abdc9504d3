"""One process at a time over a cache entry: an exclusive ``flock`` on a lock file.

The builders of the cache (the attention kernel's compile, a GGUF's conversion) take it so that
a second engine starting meanwhile waits and then finds the first one's result instead of doing
the same minute of work again. The kernel releases the lock with its holder, so a builder that
was killed never wedges the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if absent) for the ``with`` block;
    ``on_wait`` is called once, before blocking, when another process holds it."""
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
