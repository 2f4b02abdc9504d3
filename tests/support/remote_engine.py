"""A fake engine on another machine, as far as telemetry says: health beats on ``endpoint``
naming this process's pid but another host (``gpu-node-7``), for the tests of what a client
may do with a pid that is not its machine's (the Stacks screen, `vconsole stacks`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

REMOTE_HOST = "gpu-node-7"


@contextmanager
def remote_engine_beats(endpoint: str, interval_s: float = 0.05) -> Iterator[dict]:
    """Send the health body every ``interval_s`` while the block runs; yields the body."""
    import zmq

    from vconsole.engine.publish.beacon import HealthBeacon
    from vconsole.engine.publish.bodies import health_body

    beacon = HealthBeacon(zmq.Context.instance(), endpoint, "remote-engine", 0)
    body = {**health_body("idle", uptime_s=1.0, steps=0, interval_s=0.1, started_ts=0.0),
            "host": {"name": REMOTE_HOST, "boot_id": "0000"}}
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            beacon._send("health", body)
            stop.wait(interval_s)

    sender = threading.Thread(target=beat, daemon=True)
    sender.start()
    try:
        yield body
    finally:
        stop.set()
        sender.join()
        beacon.close()
