"""`vconsole demo`: an engine process, a varying load and the console, started and stopped as one.

`DemoStack` runs the engine as a child (`vconsole.engine.proc.engine_process.EngineProcess`: its
own process group, endpoints and control key learned from its ready file) and adds the load
generator (a thread in this process). It is what `main`, the tests and
``scripts/screenshots.py`` use; the console itself is imported only in `main`, so the process
management is testable without a terminal.

Invariant: when `DemoStack` exits — normally, on Ctrl-C, or because the console crashed —
nothing it started is left running: the load thread is stopped and the engine stopped
(`EngineProcess.stop`: SIGTERM to its group, a clean drain, then SIGKILL if it has not exited in
time).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vconsole.engine.proc.engine_process import (
    EngineProcess,
    engine_env_beside_clients,
    loopback_endpoints,
)
from vconsole.tools.loadgen import LoadThread, demo_rate, demo_spec

# The demo's engine: small enough that bursts fill the KV pool and preempt (80 blocks: with the
# engine's own forward, 128 drained too fast to ever preempt), with priorities to
# show (`vconsole bench soak` runs the same).
DEMO_ENGINE_DEFAULTS = {"num_kv_blocks": 80, "max_num_seqs": 16, "policy": "hybrid"}
DEMO_ENGINE_ARGS = [arg for key, value in DEMO_ENGINE_DEFAULTS.items()
                    for arg in (f"--{key.replace('_', '-')}", str(value))]


class DemoStack:
    """Engine process + load thread. Use as a context manager; see the module invariant."""

    def __init__(self, engine_args: Sequence[str] = (), *, rate: float = 4.0,
                 base_port: int = 0, load: bool = True, log_path: str | Path | None = None,
                 seed: int = 0) -> None:
        self.engine = EngineProcess(engine_args, endpoints=loopback_endpoints(base_port),
                                    env=engine_env_beside_clients(),
                                    log_path=log_path)
        self.rate = rate
        self.load_enabled = load
        self.seed = seed
        self.load: LoadThread | None = None

    @property
    def endpoints(self) -> dict[str, str]:
        return self.engine.endpoints

    def start(self) -> DemoStack:
        try:
            self.engine.start()
            if self.load_enabled:
                self.load = LoadThread(self.endpoints["input"], self.endpoints["output"],
                                       demo_spec(self.seed), rate_fn=demo_rate(self.rate))
                self.load.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            if self.load is not None:
                self.load.stop()
        finally:
            self.engine.stop()

    def __enter__(self) -> DemoStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
