"""Ports a test can listen on: picked at random below the machine's ephemeral range (a client's
connection never holds them in TIME_WAIT) and bound once to check, so tests that run beside
each other (pytest-xdist workers, a second checkout's CI) do not meet on a fixed number."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20_000, 32_000      # under Linux's default ip_local_port_range (32768-60999)


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_block(n: int = 4) -> int:
    """The first of ``n`` consecutive free ports: our engine's base port (input, output,
    telemetry, control at base .. base+3), or a stand-in's few."""
    rng = random.SystemRandom()
    for _ in range(500):
        base = rng.randrange(LOW, HIGH - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {LOW}-{HIGH}")


def free_bases(count: int, n: int = 4) -> tuple[int, ...]:
    """``count`` different blocks of ``n`` consecutive free ports."""
    out: list[int] = []
    while len(out) < count:
        base = free_block(n)
        if all(abs(base - b) >= n for b in out):
            out.append(base)
    return tuple(out)


def free_port() -> int:
    return free_block(1)
