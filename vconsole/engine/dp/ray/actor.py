"""RankActor: one data-parallel rank as a Ray actor (vLLM's ``DPEngineCoreActor``).

The actor runs the rank exactly as a process rank does — the same `EngineCoreProc`, the same
`vconsole.engine.dp.rank.rank_role.RankRole` and busy loop — only the process is a Ray
worker placed by the rank's placement group. The launcher (`vconsole.engine.dp.ray.launcher`)
calls `start` (bind, join the store, load the model; returns the rank's ready record) and then
`run` (the busy loop, until `stop`; returns the engine's exit code), as vLLM's actor has
``wait_for_init`` and ``run``. Two calls run at once (``max_concurrency`` 2): `stop` arrives
while `run` blocks.

Endpoints: ``tcp://HOST:*`` with HOST 127.0.0.1 when the actor shares the front end's node, else
its node's address (never a wildcard); beyond loopback the sockets are CURVE servers with the
``--dp-curve-dir`` keys, read on the actor's node, and the bind policy refuses them without
(`check_endpoints`, before anything binds), as torchrun ranks do.

The rank's ``dp`` topic and its ready record carry its placement: ``node`` (the node's host
name), ``node_ip``, ``actor`` (the actor's name) and ``actor_id``; the ready record also the
Ray ``namespace`` and the cluster's ``ray_address`` (to reach the actor with Ray's own tools).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vconsole.engine.dp.front.torchrun import rank_curves, rank_endpoints
from vconsole.engine.dp.rank.rank_role import RankRole
from vconsole.engine.dp.rank.rendezvous import DPEnv
from vconsole.engine.process.loop_inputs import LoopInput, Shutdown
from vconsole.security.bind_policy import check_endpoints
from vconsole.wire.ready_file import ENDPOINT_NAMES

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.engine.process.core_proc import EngineCoreProc

LOOPBACK = "127.0.0.1"


def actor_name(rank: int) -> str:
    return f"vconsole_dp_rank_{rank}"


class RankActor:
    """See the module docstring; created by the launcher through ``ray.remote``."""

    def __init__(self, launch: EngineLaunch, *, front_node_id: str, restart_count: int = 0,
                 restart_reason: str | None = None) -> None:
        """``launch``: the rank's (`EngineLaunch.for_rank`: its rank, the store), endpoints
        left to `start`; ``front_node_id``: the Ray node the front end runs on."""
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.launch = launch
        self.front_node_id = front_node_id
        self.restart_count = restart_count
        self.restart_reason = restart_reason
        self.queue: queue.SimpleQueue[LoopInput] = queue.SimpleQueue()
        self.proc: EngineCoreProc | None = None

    def placement(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ctx.get_node_id(), "actor": actor_name(self.launch.config.dp_rank),
                "actor_id": ctx.get_actor_id(), "namespace": ctx.namespace,
                "ray_address": ctx.gcs_address}

    def start(self) -> dict[str, Any]:
        """Bind, join the group's store, load the model, start the I/O threads; the rank's
        ready record (plus ``placement``). Raises what a rank's start raises (a refused bind,
        an unreachable store, a model that does not load)."""
        from vconsole.engine.process.core_proc import EngineCoreProc, freeze_startup_heap

        where = self.placement()
        host = LOOPBACK if where["node_id"] == self.front_node_id else where["node_ip"]
        private = rank_endpoints(ENDPOINT_NAMES, host)
        curve, _ = rank_curves(self.launch.dp_curve_dir, front_end=False)
        check_endpoints(private, False, curve=curve is not None)
        launch = replace(self.launch, endpoints=private)
        role = RankRole(DPEnv.from_config(launch.config),
                        placement={k: where[k] for k in ("node", "node_ip", "actor",
                                                         "actor_id")})
        self.proc = EngineCoreProc(
            launch.config, dict(launch.endpoints), role=role,
            config_path=launch.source.config_file, control_key_file=None,
            input_queue=self.queue, curve=curve, restart_count=self.restart_count,
            restart_reason=self.restart_reason)
        freeze_startup_heap()       # this actor's process is the rank
        self.proc.start()
        ep = self.proc.endpoints
        print(f"vconsole engine {launch.config.engine_id} rank {launch.config.dp_rank} ready "
              f"(Ray actor {where['actor']} on {where['node']}): input={ep['input']} "
              f"output={ep['output']} telemetry={ep['telemetry']} control={ep['control']}",
              file=sys.stderr, flush=True)
        return {**self.proc.ready_info, "pid": os.getpid(), "endpoints": dict(ep),
                "control_key_file": self.proc.control_server.key_file, "placement": where}

    def run(self) -> int:
        """The busy loop until `stop` (or the loop's own exit); the engine's exit code."""
        assert self.proc is not None, "start first"
        self.proc.run_busy_loop()
        return self.proc.exit_code

    def stop(self, reason: str = "stopped") -> None:
        """Drain and stop (from any thread, as a signal would)."""
        self.queue.put(Shutdown(reason))

