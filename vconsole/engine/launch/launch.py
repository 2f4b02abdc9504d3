"""EngineLaunch: everything ``vconsole engine`` was asked to do, read once from its command line.

The CLI builds one `EngineLaunch` (`vconsole.commands.engine.launch_from_args`) and hands it to
whichever of the four shapes runs: the engine in this process (`EngineCoreProc`), its supervisor
(`vconsole.engine.launch.supervisor`), the data-parallel launcher (`vconsole.engine.dp.
launcher`) or a torchrun rank with its front end (`vconsole.engine.dp.front.torchrun`). A process
that starts another engine process derives the child's launch with `dataclasses.replace` (a
rank: its rank, its private endpoints, no public metrics) and runs `EngineLaunch.argv`: the
command line that gives the same launch back. Nothing downstream reads an ``argparse.Namespace``
or edits somebody's argv.

Invariant (tested): parsing ``vconsole engine`` + `argv()` gives back an equal launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vconsole.engine.config_source import ConfigSource
from vconsole.shared.config import EngineConfig

if TYPE_CHECKING:
    from vconsole.security.curve_server import ServerCurve


@dataclass(frozen=True)
class Supervision:
    """How the supervisor restarts the engine (``--max-restarts`` …), or ``enabled`` False
    (``--no-supervisor``)."""

    enabled: bool = True
    max_restarts: int = 5
    restart_window_s: float = 300.0
    restart_backoff_s: float = 0.5
    hang_timeout_s: float = 60.0    # no busy-loop pass this long with work pending = hung

    def argv(self) -> list[str]:
        return ([] if self.enabled else ["--no-supervisor"]) + [
            "--max-restarts", str(self.max_restarts),
            "--restart-window", repr(self.restart_window_s),
            "--restart-backoff", repr(self.restart_backoff_s),
            "--hang-timeout", repr(self.hang_timeout_s)]


@dataclass(frozen=True)
class ChildOfSupervisor:
    """What a supervisor tells the engine process it runs (hidden flags)."""

    liveness_file: str | None = None
    failure_file: str | None = None
    restart_count: int = 0
    restart_reason: str | None = None

    def argv(self) -> list[str]:
        out = ["--supervised-child", "--restart-count", str(self.restart_count)]
        if self.liveness_file:
            out += ["--liveness-file", self.liveness_file]
        if self.failure_file:
            out += ["--failure-file", self.failure_file]
        if self.restart_reason is not None:
            out.append(f"--restart-reason={self.restart_reason}")
        return out


@dataclass(frozen=True)
class EngineLaunch:
    """See the module docstring. ``config`` is ``source.build()``, checked once by the CLI."""

    source: ConfigSource
    config: EngineConfig
    endpoints: Mapping[str, str]
    ready_file: str | None = None
    control_key_file: str | None = None
    allow_remote: bool = False                     # --allow-remote-telemetry
    curve_server_key: str | None = None
    curve_clients: str | None = None
    metrics: tuple[str, int] | None = None         # (--metrics-host, --metrics-port)
    allow_remote_metrics: bool = False
    dp_rank_host: str | None = None
    dp_curve_dir: str | None = None
    dp_backend: str = "mp"                         # --data-parallel-backend: mp | ray
    ray_address: str | None = None
    supervision: Supervision = Supervision()
    child: ChildOfSupervisor | None = None         # set: run by a supervisor

    @property
    def supervised_child(self) -> bool:
        return self.child is not None

    @property
    def one_rank(self) -> bool:
        """This process serves one engine: a supervised child, or a rank given ``--dp-rank``
        (never the launcher of a group)."""
        return self.child is not None or self.source.flags.get("dp_rank") is not None

    def server_curve(self) -> ServerCurve | None:
        """The CURVE server keys the flags name (None without); `CurveKeyError` if wrong."""
        from vconsole.security.curve_server import load_server_curve

        return load_server_curve(self.curve_server_key, self.curve_clients)

    def for_child(self, child: ChildOfSupervisor, endpoints: Mapping[str, str], *,
                  ready_file: str, metrics: tuple[str, int] | None) -> EngineLaunch:
        """The launch a supervisor gives its child: the same engine on ``endpoints``."""
        return replace(self, child=child, endpoints=dict(endpoints), ready_file=ready_file,
                       metrics=metrics)

    def for_rank(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 endpoints: Mapping[str, str], control_key_file: str) -> EngineLaunch:
        """A data-parallel rank of this launch (one host): private endpoints and key, no
        public metrics, no CURVE (the ranks' ipc endpoints are private to this user)."""
        source = self.source.with_flags(data_parallel_size=world_size, dp_rank=rank,
                                        dp_master_addr=master_addr, dp_master_port=master_port)
        return replace(self, source=source, config=source.build(), endpoints=dict(endpoints),
                       control_key_file=control_key_file, ready_file=None, metrics=None,
                       allow_remote=False, allow_remote_metrics=False, curve_server_key=None,
                       curve_clients=None)

    def argv(self) -> list[str]:
        """``vconsole engine`` flags that give this launch back (`vconsole.engine.launch.child.
        engine_command` runs them)."""
        out = self.source.argv()
        for name, ep in self.endpoints.items():
            out.append(f"--{name}={ep}")
        for flag, value in (("--ready-file", self.ready_file),
                            ("--control-key-file", self.control_key_file),
                            ("--curve-server-key", self.curve_server_key),
                            ("--curve-clients", self.curve_clients),
                            ("--dp-rank-host", self.dp_rank_host),
                            ("--dp-curve-dir", self.dp_curve_dir)):
            if value is not None:
                out += [flag, value]
        if self.dp_backend != "mp":
            out += ["--data-parallel-backend", self.dp_backend]
        if self.ray_address is not None:
            out += ["--ray-address", self.ray_address]
        if self.allow_remote:
            out.append("--allow-remote-telemetry")
        if self.metrics is not None:
            out += ["--metrics-host", self.metrics[0], "--metrics-port", str(self.metrics[1])]
        if self.allow_remote_metrics:
            out.append("--allow-remote-metrics")
        out += self.supervision.argv()
        if self.child is not None:
            out += self.child.argv()
        return out
