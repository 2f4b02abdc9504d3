"""RankLink: the data-parallel front end's connection to one rank, and the socket drain helper.

A link is a DEALER pair with the front end's identity, connected to the rank's private input and
output endpoints; ``info`` is the rank's ``ready`` (None until it answered the front end's
``hello``), ``last_heard`` when anything last came from it. Used by the ``dp-frontend`` thread
only (`vconsole.engine.dp.front.requests`), which also closes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq

DRAIN_MAX = 64            # messages handled per readable socket per poll


def drain(sock: zmq.Socket, most: int = DRAIN_MAX) -> list[list[bytes]]:
    """Up to ``most`` messages waiting on a readable socket (at least the first)."""
    batch = [sock.recv_multipart()]
    while len(batch) < most:
        try:
            batch.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return batch


@dataclass
class RankLink:
    """The front end's connection to one rank (dp-frontend thread only)."""

    rank: int
    endpoints: dict[str, str]
    input: zmq.Socket
    output: zmq.Socket
    info: dict[str, Any] | None = None      # its ``ready``: None until it answered hello
    last_heard: float = field(default_factory=time.monotonic)
    warned: bool = False                    # "has not answered" was logged

    @property
    def up(self) -> bool:
        return self.info is not None

    @property
    def dp(self) -> bool:
        return self.info is not None and int(self.info.get("data_parallel_size") or 1) > 1

    def close(self) -> None:
        self.input.close(0)
        self.output.close(0)
