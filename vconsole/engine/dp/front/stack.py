"""FrontEndStack: the public side of a data-parallel group, as one object to start and close.

It binds the four public endpoints and serves them from threads: requests (`DPFrontEnd`),
telemetry (`TelemetryProxy`), control (`ControlFanout`, with its own key file) and, with a
metrics port, Prometheus over every rank (`vconsole.engine.publish.prometheus.RanksCollector`,
``engine="<rank>"``). Whoever runs the ranks tells it about them: `rank_ready(r, record)` with
the rank's ready record (endpoints, control key file, pid) and `rank_exit(r, reason, ...)`;
it keeps the public ready file up to date (written once every rank was ready and answered the
front end's ``hello``, so a client of the ready file reaches a group that routes to every rank;
with ``ranks`` ``[{rank, pid, ready_file}]``, plus a Ray actor rank's ``placement``: ``node``,
``node_ip``, ``node_id``, ``actor``, ``actor_id``). With ``rank_curve`` (torchrun over several hosts) every
connection to a rank is a CURVE client, and a rank's control key comes with its ``ready``
(the front end hands it to the fan-out) instead of from its key file. Used by the single-host launcher
(`vconsole.engine.dp.launcher`) and by torchrun's global rank 0
(`vconsole.engine.dp.front.torchrun`).

Invariant: the bind policy is checked before anything binds; `close` leaves no thread, socket,
key file or ready file of this stack behind.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.engine.dp.front.control_fanout import ControlFanout
from vconsole.engine.dp.front.requests import DPFrontEnd
from vconsole.engine.dp.front.telemetry_proxy import TelemetryProxy
from vconsole.security.bind_policy import (
    check_endpoints,
    check_metrics_host,
    request_text_refusal,
)
from vconsole.security.control_key import control_key_file as derive_key_file
from vconsole.security.engine_key import refuse_if_held
from vconsole.telemetry.request_text import KEY as TEXT_KEY
from vconsole.wire.ready_file import (
    ENDPOINT_NAMES,
    ready_record,
    remove_ready_file,
    write_ready_file,
)

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.security.curve import ClientCurve
    from vconsole.security.curve_server import ServerCurve
    from vconsole.shared.config import EngineConfig

log = logging.getLogger("vconsole.engine.dp")

def without_refused_text(launch: EngineLaunch, refusal: str | None, *,
                         warn: bool) -> EngineLaunch:
    """``launch`` with ``publish_request_text=false`` added to its overrides when ``refusal``
    (the group's public telemetry socket's `request_text_refusal`) is set and its config turns
    request text on; ``warn``: say so in the log (once per group)."""
    if refusal is None or not launch.config.publish_request_text:
        return launch
    if warn:
        log.warning("%s It stays off on every rank.", refusal)
    source = replace(launch.source, overrides=(*launch.source.overrides,
                                               f"{TEXT_KEY}=false"))
    return replace(launch, source=source, config=source.build())


class FrontEndStack:
    @classmethod
    def for_launch(cls, launch: EngineLaunch, world_size: int, *, curve: ServerCurve | None,
                   **kwargs: Any) -> FrontEndStack:
        """The front end of the group ``launch`` starts, on its public endpoints, key file,
        ready file and metrics port."""
        return cls(launch.config, dict(launch.endpoints), world_size,
                   allow_remote=launch.allow_remote, curve=curve,
                   control_key_file=launch.control_key_file, ready_file=launch.ready_file,
                   metrics=launch.metrics, allow_remote_metrics=launch.allow_remote_metrics,
                   **kwargs)

    def __init__(self, config: EngineConfig, public: dict[str, str], world_size: int, *,
                 allow_remote: bool = False, curve: ServerCurve | None = None,
                 control_key_file: str | None = None, ready_file: str | None = None,
                 metrics: tuple[str, int] | None = None, allow_remote_metrics: bool = False,
                 announce: bool = True, liveness: bool = False,
                 rank_curve: ClientCurve | None = None) -> None:
        """``liveness``: the front end also takes a rank whose heartbeats stopped out of
        routing (torchrun, where no supervisor reports a rank's death). ``rank_curve``: the
        front end's CURVE client keys for the ranks' sockets (None: plain loopback/ipc)."""
        check_endpoints(public, allow_remote, curve=curve is not None)
        if metrics is not None:
            check_metrics_host(metrics[0], allow_remote_metrics)
        refuse_if_held(derive_key_file(public["control"], control_key_file))
        # Why the public telemetry socket may not carry request text (the ranks publish on
        # private ones and cannot tell): the launchers turn it off in the ranks' configs
        # (`without_refused_text`), the control fan-out refuses to turn it on, and the proxy
        # takes it out of whatever a rank still sends (a reloaded config file).
        self.text_refusal = request_text_refusal(public["telemetry"], curve is not None)
        self.config = config
        self.world_size = world_size
        self.ready_file = ready_file
        self.announce = announce
        self.ranks: list[dict[str, Any]] = [{"rank": r, "pid": None, "ready_file": None}
                                            for r in range(world_size)]
        self._answered: set[int] = set()     # ranks whose link got its ready
        self._lock = threading.Lock()
        self._announced = False
        self.ctx = zmq.Context()
        self._auth = curve.start_authenticator(self.ctx) if curve is not None else None
        self._parts: list[Any] = []
        try:
            self.proxy = TelemetryProxy(public["telemetry"], ctx=self.ctx, curve=curve,
                                        allow_remote=allow_remote, sndhwm=config.zmq_sndhwm,
                                        engine_id=config.engine_id,
                                        heartbeat_s=config.heartbeat_interval_s,
                                        rank_curve=rank_curve,
                                        text_refusal=self.text_refusal).start()
            self._parts.append(self.proxy)
            self.frontend = DPFrontEnd(public, world_size, allow_remote=allow_remote,
                                       curve=curve, ctx=self.ctx, sndhwm=config.zmq_sndhwm,
                                       kv_usage=self.proxy.kv_usage,
                                       liveness=liveness, rank_curve=rank_curve,
                                       on_ready=self._rank_answered).start()
            self._parts.append(self.frontend)
            self.fanout = ControlFanout(public["control"], world_size,
                                        control_key_file=control_key_file, ctx=self.ctx, curve=curve,
                                        engine_id=config.engine_id,
                                        rank_curve=rank_curve,
                                        text_refusal=self.text_refusal).start()
            self._parts.append(self.fanout)
            self.metrics = None
            if metrics is not None:
                from vconsole.engine.publish.prometheus import MetricsServer, RanksCollector
                self.metrics = MetricsServer(RanksCollector(self.proxy.bodies_by_rank,
                                                            model_name=config.model),
                                             *metrics).start()
                self._parts.append(self.metrics)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> dict[str, str]:
        return {"input": self.frontend.endpoints["input"],
                "output": self.frontend.endpoints["output"],
                "telemetry": self.proxy.endpoint, "control": self.fanout.endpoint}

    def watch(self, rank: int, telemetry: str) -> None:
        """Listen to ``rank``'s telemetry before it is ready (ipc endpoints known in advance),
        so nothing it publishes at start is missed."""
        self.proxy.connect(rank, telemetry)

    def rank_ready(self, rank: int, record: dict[str, Any],
                   ready_file: str | None = None) -> None:
        eps = {n: record["endpoints"][n] for n in ENDPOINT_NAMES}
        self.proxy.connect(rank, eps["telemetry"])
        self.fanout.set_rank(rank, eps["control"], record.get("control_key_file"))
        self.frontend.rank_up(rank, eps)
        self.proxy.rank_up(rank)
        with self._lock:
            self.ranks[rank].update(pid=record.get("pid"),
                                    ready_file=ready_file or self.ranks[rank]["ready_file"],
                                    **(record.get("placement") or {}))
            self._write_ready_if_all()

    def _rank_answered(self, rank: int, control_key: str | None) -> None:
        """From the dp-frontend thread: ``rank``'s link got its first ``ready`` (a CURVE rank's
        carries its control key, for the fan-out)."""
        fanout = getattr(self, "fanout", None)
        if control_key is not None and fanout is not None:
            fanout.set_key(rank, control_key)
        with self._lock:
            self._answered.add(rank)
            self._write_ready_if_all()

    def _write_ready_if_all(self) -> None:
        if all(r["pid"] is not None and r["rank"] in self._answered for r in self.ranks):
            self._write_ready()

    def rank_exit(self, rank: int, reason: str, *, restarting: bool = False,
                  restart_count: int = 0) -> None:
        """Rank ``rank``'s process ended (``reason``: "killed by SIGKILL"); with
        ``restarting`` the proxy publishes ``restarting`` for it until it is ready again."""
        self.fanout.rank_down(rank)
        self.frontend.rank_down(rank, reason)
        if restarting:
            self.proxy.rank_down(rank, reason, restart_count)
        with self._lock:
            self.ranks[rank]["pid"] = None
            self._answered.discard(rank)

    def _write_ready(self) -> None:
        record = ready_record(
            engine_id=self.config.engine_id, pid=os.getpid(), endpoints=self.endpoints,
            control_key_file=self.fanout.control_key_file, data_parallel_size=self.world_size,
            ranks=[dict(r) for r in self.ranks], model=self.config.model,
            **({"metrics": self.metrics.url} if self.metrics is not None else {}))
        if not self._announced and self.announce:
            eps = record["endpoints"]
            print(f"vconsole engine {self.config.engine_id} ready (data parallel, "
                  f"{self.world_size} ranks, pid {os.getpid()}): input={eps['input']} "
                  f"output={eps['output']} telemetry={eps['telemetry']} "
                  f"control={eps['control']}"
                  + (f" metrics={self.metrics.url}" if self.metrics is not None else ""),
                  flush=True)
        self._announced = True
        if self.ready_file is not None:
            write_ready_file(self.ready_file, record)

    def close(self) -> None:
        for part in reversed(self._parts):
            part.close()
        self._parts.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)
        if self.ready_file is not None:
            remove_ready_file(self.ready_file, os.getpid())
