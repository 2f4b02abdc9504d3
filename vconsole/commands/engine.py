"""`vconsole engine`: run EngineCoreProc until SIGINT/SIGTERM, under a supervisor by default.

With ``--data-parallel-size N`` (N > 1) and no ``--dp-rank``, this process is the
data-parallel launcher (`vconsole.engine.dp.launcher`); as a torchrun worker it is one
rank (plus the front end on global rank 0); with ``--dp-rank`` it is that one rank. N == 1 is
the path below.
Without ``--no-supervisor`` this process is the `EngineSupervisor`
(`vconsole.engine.launch.supervisor`), which runs the same command line with
``--supervised-child`` as its child and restarts it when it dies; the child (or
``--no-supervisor``) runs the engine in this process. Exit codes:
`vconsole.wire.exit_codes`.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.engine import omp_wait
from vconsole.engine.config_source import ConfigSource
from vconsole.engine.dp.rank.choose import process_role
from vconsole.engine.launch import stack_dump
from vconsole.engine.launch.launch import ChildOfSupervisor, EngineLaunch, Supervision
from vconsole.engine.launch.supervisor import EngineSupervisor
from vconsole.engine.process.core_proc import EngineCoreProc, freeze_startup_heap
from vconsole.engine.process.loop_inputs import LoopInput, Reload, Shutdown
from vconsole.security.bind_policy import RemoteBindRefused, check_metrics_host
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULTS
from vconsole.shared.config import ConfigError
from vconsole.wire import exit_codes

if TYPE_CHECKING:
    from collections.abc import Callable

    from vconsole.engine.dp.front.torchrun import TorchrunFrontEnd
    from vconsole.security.curve_server import ServerCurve


def _install_signal_handlers(q: queue.SimpleQueue[LoopInput], *,
                             escalate: bool = True) -> None:
    """SIGINT/SIGTERM: drain and exit 0 (a second one: exit now, unless ``escalate`` is off:
    a supervised child hears a group's signal twice, directly and passed on, and leaves
    escalation to its supervisor). SIGHUP: reload --config."""
    count = 0

    def on_stop(signum: int, _frame: Any) -> None:
        nonlocal count
        count += 1
        if count > 1:
            if escalate:
                raise KeyboardInterrupt
            return
        q.put(Shutdown(signal.Signals(signum).name))

    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGTERM, on_stop)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: q.put(Reload("SIGHUP")))


def launch_from_args(args: argparse.Namespace) -> EngineLaunch:
    """The one read of `vconsole engine`'s flags (`vconsole.cli`); raises what
    `ConfigSource.build` raises for a config that is wrong."""
    source = ConfigSource.from_flags(args)
    child = None
    if args.supervised_child:
        child = ChildOfSupervisor(liveness_file=args.liveness_file,
                                  failure_file=args.failure_file,
                                  restart_count=args.restart_count or 0,
                                  restart_reason=args.restart_reason)
    return EngineLaunch(
        source=source, config=source.build(),
        endpoints={name: getattr(args, name) or default for name, default in DEFAULTS.items()},
        ready_file=args.ready_file, control_key_file=args.control_key_file,
        allow_remote=args.allow_remote, curve_server_key=args.curve_server_key,
        curve_clients=args.curve_clients,
        metrics=None if args.metrics_port is None else (args.metrics_host or "127.0.0.1",
                                                        args.metrics_port),
        allow_remote_metrics=args.allow_remote_metrics, dp_rank_host=args.dp_rank_host,
        dp_curve_dir=args.dp_curve_dir,
        dp_backend=getattr(args, "data_parallel_backend", None) or "mp",
        ray_address=getattr(args, "ray_address", None),
        supervision=Supervision(enabled=not args.no_supervisor, max_restarts=args.max_restarts,
                                restart_window_s=args.restart_window,
                                restart_backoff_s=args.restart_backoff,
                                hang_timeout_s=args.hang_timeout),
        child=child)


def _fatal(failure_file: str | None, message: str) -> None:
    """Say why this engine cannot go on, once. A supervised child leaves the words to its
    supervisor (``--failure-file``), which prints them in its own last line; anyone else prints
    them here."""
    if failure_file:
        try:
            Path(failure_file).write_text(message)
            return
        except OSError:
            pass
    print(f"vconsole engine: {message}", file=sys.stderr)


def _say(message: object) -> None:
    print(f"vconsole engine: {message}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    omp_wait.prefer_short_spin()     # before anything imports torch: see the module
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        launch = launch_from_args(args)
    except ConfigError as e:
        _fatal(args.failure_file, f"invalid config: {e}")
        return 2
    except (ValueError, OSError) as e:  # an unreadable --config file
        _fatal(args.failure_file, str(e))
        return 2
    one_rank = launch.one_rank
    if not one_rank and _torchrun_world() > 1:
        return _torchrun_rank(launch)
    if launch.dp_backend == "ray" and not one_rank:
        return _launch_ray_ranks(launch)
    if launch.ray_address is not None and not one_rank:
        _say("--ray-address is for --data-parallel-backend ray")
        return exit_codes.CANNOT_START
    multi_host = [f for f, v in (("--dp-rank-host", launch.dp_rank_host),
                                 ("--dp-curve-dir", launch.dp_curve_dir)) if v]
    if not one_rank and multi_host:
        _say(f"{multi_host[0]} is for torchrun workers (ranks on several hosts); this "
             "engine's ranks, if any, use private ipc endpoints on this host")
        return exit_codes.CANNOT_START
    if not one_rank and launch.config.data_parallel_size > 1:
        return _launch_ranks(launch)
    if not launch.supervised_child and launch.supervision.enabled:
        return _supervise(launch)
    return _serve(launch, escalate=not launch.supervised_child)


def _serve(launch: EngineLaunch, *, escalate: bool = True, curve: Any = True,
           front: TorchrunFrontEnd | None = None) -> int:
    """Run the engine in this process until it is stopped. Its role is picked here: one rank
    of a data-parallel group (``--dp-rank``, or a torchrun worker) or a lone engine
    (`vconsole.engine.dp.rank.choose`). ``curve`` True: the launch's own keys. ``front``: a
    torchrun group's front end, started once the engine serves and closed after it drained."""
    failure_file = launch.child.failure_file if launch.child else None
    q: queue.SimpleQueue[LoopInput] = queue.SimpleQueue()
    _install_signal_handlers(q, escalate=escalate)
    stack_dump.install()        # SIGUSR2: its own stacks, for `vconsole stacks` and the watchdog
    try:
        proc = EngineCoreProc(
            launch.config, dict(launch.endpoints), role=process_role(launch.config),
            config_path=launch.source.config_file,
            allow_remote=launch.allow_remote, control_key_file=launch.control_key_file,
            input_queue=q, ready_file=launch.ready_file,
            curve=launch.server_curve() if curve is True else curve,
            restart_count=launch.child.restart_count if launch.child else 0,
            restart_reason=launch.child.restart_reason if launch.child else None,
            liveness_file=launch.child.liveness_file if launch.child else None,
            metrics_endpoint=launch.metrics, allow_remote_metrics=launch.allow_remote_metrics)
    except (RemoteBindRefused, CurveKeyError, OSError) as e:
        _fatal(failure_file, str(e))
        return 2
    except ValueError as e:  # the model or the KV pool: the loader says why
        _fatal(failure_file, f"cannot start: {e}")
        return 1
    _log_threads()
    freeze_startup_heap()
    proc.start()
    stack_dump.refresh_names()
    ep = proc.endpoints
    print(f"vconsole engine {launch.config.engine_id} ready (pid {os.getpid()}): "
          f"input={ep['input']} output={ep['output']} telemetry={ep['telemetry']} "
          f"control={ep['control']}"
          + (f" metrics={proc.metrics.url}" if proc.metrics is not None else ""), flush=True)
    if front is not None:
        front.start()
    try:
        proc.run_busy_loop()
    finally:
        if front is not None:
            front.close()
    return proc.exit_code


def _log_threads() -> None:
    import torch

    logging.getLogger("vconsole.engine").info(
        "torch threads: %d; OpenMP threads wait: %s (GOMP_SPINCOUNT, OMP_WAIT_POLICY; "
        "vconsole.engine.omp_wait)",
        torch.get_num_threads(), omp_wait.describe())


def _torchrun_world() -> int:
    """WORLD_SIZE when this process is a torchrun worker (RANK and WORLD_SIZE set), else 1."""
    if os.environ.get("RANK") is None:
        return 1
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def _torchrun_rank(launch: EngineLaunch) -> int:
    """A torchrun worker is one rank (no supervisor: torchrun restarts the group) on private
    endpoints, ``tcp://--dp-rank-host:*`` (loopback by default; beyond it only as CURVE servers
    with ``--dp-curve-dir`` keys, refused before anything binds); global rank 0 also runs the
    front end on the public ones (`vconsole.engine.dp.front.torchrun`)."""
    from vconsole.engine.dp.front.torchrun import (
        TorchrunFrontEnd,
        rank_curves,
        rank_endpoints,
        rank_launch,
    )
    from vconsole.security.bind_policy import check_endpoints
    front_end = int(os.environ.get("RANK") or 0) == 0
    try:
        curve = launch.server_curve()
        private = rank_endpoints(launch.endpoints, launch.dp_rank_host)
        check_endpoints(private, False, curve=bool(launch.dp_curve_dir))
        rank_curve, front_curve = rank_curves(launch.dp_curve_dir, front_end=front_end)
    except (ValueError, CurveKeyError) as e:    # RemoteBindRefused is a ValueError
        _say(e)
        return exit_codes.CANNOT_START
    try:
        front = (TorchrunFrontEnd(launch, curve=curve, rank_curve=front_curve)
                 if front_end else None)
    except (RemoteBindRefused, OSError) as e:
        _say(e)
        return exit_codes.CANNOT_START
    # The group's /metrics, control key and public telemetry are the front end's.
    rank = rank_launch(launch, private, public_curve=curve is not None, front_end=front_end)
    # A stop reaches a rank twice (the terminal's or a killpg's signal to the whole group, and
    # torchrun's agent passing it on): the rank drains on the first and ignores the rest;
    # torchrun escalates (SIGKILL after its grace period).
    return _serve(rank, curve=rank_curve, front=front, escalate=False)


def _run_group(launch: EngineLaunch, run: Callable[[ServerCurve | None], int]) -> int:
    """A data-parallel launcher's ``run(curve)`` with the public endpoints' CURVE keys; a key,
    bind or Ray (``ConnectionError``) refusal before any rank starts exits 2 with its message."""
    try:
        curve = launch.server_curve()
    except (ValueError, CurveKeyError) as e:
        _say(e)
        return exit_codes.CANNOT_START
    try:
        return run(curve)
    except (RemoteBindRefused, CurveKeyError, OSError) as e:
        _say(e)
        return exit_codes.CANNOT_START


def _launch_ranks(launch: EngineLaunch) -> int:
    """N ranks behind one front end on this host: `vconsole.engine.dp.launcher`."""
    from vconsole.engine.dp.launcher import DPLauncher

    return _run_group(launch, lambda curve: DPLauncher(launch, curve=curve).run())


def ray_missing() -> str | None:
    """Why ``--data-parallel-backend ray`` cannot run here (None: Ray is installed)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "--data-parallel-backend ray needs Ray, which is not installed: " \
               "pip install 'vconsole[ray]'"
    return None


def _launch_ray_ranks(launch: EngineLaunch) -> int:
    """N ranks as Ray actors behind one front end here: `vconsole.engine.dp.ray.launcher`."""
    missing = ray_missing()
    if missing:
        _say(missing)
        return exit_codes.CANNOT_START
    if launch.config.data_parallel_size < 2:
        _say("--data-parallel-backend ray needs --data-parallel-size 2 or more")
        return exit_codes.CANNOT_START
    if launch.dp_rank_host:
        _say("--dp-rank-host is for torchrun workers; a Ray rank binds its own node's address")
        return exit_codes.CANNOT_START
    from vconsole.engine.dp.ray.launcher import RayLauncher

    return _run_group(launch, lambda curve: RayLauncher(
        launch, curve=curve, ray_address=launch.ray_address).run())


def _supervise(launch: EngineLaunch) -> int:
    """Run this engine as a supervised child; see `EngineSupervisor`."""
    try:
        curve = launch.server_curve()
        if launch.metrics is not None:
            check_metrics_host(launch.metrics[0], launch.allow_remote_metrics)
    except (ValueError, CurveKeyError) as e:
        _say(e)
        return exit_codes.CANNOT_START
    supervisor = EngineSupervisor(launch, curve=curve)
    try:
        code = supervisor.run()
    except OSError as e:    # the metrics port is taken
        _say(f"cannot serve metrics on {launch.metrics}: {e}")
        return exit_codes.CANNOT_START
    if supervisor.failure:
        _say(supervisor.failure)
    return code
