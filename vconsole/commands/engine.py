"""`vconsole engine`: run EngineCoreProc until SIGINT/SIGTERM, under a supervisor by default.

With ``--data-parallel-size N`` (N > 1) and no ``--dp-rank``, this process is the
data-parallel launcher (`vconsole.engine.proc.dp.launcher`); as a torchrun worker it is one
rank (plus the front end on global rank 0); with ``--dp-rank`` it is that one rank. N == 1 is
the path below.
Without ``--no-supervisor`` this process is the `EngineSupervisor`
(`vconsole.engine.proc.supervisor`), which runs the same command line with
``--supervised-child`` as its child and restarts it when it dies; the child (or
``--no-supervisor``) runs the engine in this process. Exit codes:
`vconsole.engine.proc.exit_codes`.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
from pathlib import Path
from typing import Any

from vconsole.commands.curve_args import server_curve
from vconsole.engine.config import ConfigError, config_from_args
from vconsole.engine.proc import exit_codes
from vconsole.engine.proc.core_proc import EngineCoreProc
from vconsole.engine.proc.loop_inputs import LoopInput, Reload, Shutdown
from vconsole.engine.proc.supervisor import EngineSupervisor, RestartPolicy
from vconsole.security.bind_policy import RemoteBindRefused, check_metrics_host
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULTS


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


def _fatal(args: argparse.Namespace, message: str) -> None:
    """Say why this engine cannot go on, once. A supervised child leaves the words to its
    supervisor (``--failure-file``), which prints them in its own last line; anyone else prints
    them here."""
    path = getattr(args, "failure_file", None)
    if path:
        try:
            Path(path).write_text(message)
            return
        except OSError:
            pass
    print(f"vconsole engine: {message}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as e:
        _fatal(args, f"invalid config: {e}")
        return 2
    except (ValueError, OSError) as e:  # an unreadable --config file
        _fatal(args, str(e))
        return 2
    endpoints = {name: getattr(args, name, None) or default for name, default in DEFAULTS.items()}
    supervised_child = bool(getattr(args, "supervised_child", False))
    one_rank = supervised_child or getattr(args, "dp_rank", None) is not None
    if not one_rank and _torchrun_world() > 1:
        return _torchrun_rank(args, config, endpoints)
    multi_host = [f for f in ("dp_rank_host", "dp_curve_dir") if getattr(args, f, None)]
    if not one_rank and multi_host:
        print(f"vconsole engine: --{multi_host[0].replace('_', '-')} is for torchrun workers "
              "(ranks on several hosts); this engine's ranks, if any, use private ipc "
              "endpoints on this host", file=sys.stderr)
        return exit_codes.CANNOT_START
    if not one_rank and config.data_parallel_size > 1:
        return _launch_ranks(args, config, endpoints)
    if not supervised_child and not getattr(args, "no_supervisor", False):
        return _supervise(args, config, endpoints)
    return _serve(args, config, endpoints, escalate=not supervised_child)


def _serve(args: argparse.Namespace, config: Any, endpoints: dict[str, str], *,
           escalate: bool = True, ready_file: str | None | bool = True,
           curve: Any = True, front: Any = None) -> int:
    """Run the engine in this process until it is stopped. ``front``: a torchrun group's
    front end, started once the engine serves and closed after it drained."""
    q: queue.SimpleQueue[LoopInput] = queue.SimpleQueue()
    _install_signal_handlers(q, escalate=escalate)
    try:
        proc = EngineCoreProc(config, endpoints, config_path=getattr(args, "config", None),
                              allow_remote=bool(getattr(args, "allow_remote", False)),
                              control_key_file=getattr(args, "control_key_file", None),
                              input_queue=q,
                              ready_file=(getattr(args, "ready_file", None) if ready_file is True
                                          else ready_file or None),
                              curve=server_curve(args) if curve is True else curve,
                              restart_count=getattr(args, "restart_count", 0) or 0,
                              restart_reason=getattr(args, "restart_reason", None),
                              liveness_file=getattr(args, "liveness_file", None),
                              metrics_endpoint=_metrics_endpoint(args),
                              allow_remote_metrics=bool(getattr(args, "allow_remote_metrics",
                                                                False)))
    except (RemoteBindRefused, CurveKeyError, OSError) as e:
        _fatal(args, str(e))
        return 2
    except ValueError as e:  # the model or the KV pool: the loader says why
        _fatal(args, f"cannot start: {e}")
        return 1
    proc.start()
    ep = proc.endpoints
    print(f"vconsole engine {config.engine_id} ready (pid {os.getpid()}): input={ep['input']} "
          f"output={ep['output']} telemetry={ep['telemetry']} control={ep['control']}"
          + (f" metrics={proc.metrics.url}" if proc.metrics is not None else ""), flush=True)
    if front is not None:
        front.start()
    try:
        proc.run_busy_loop()
    finally:
        if front is not None:
            front.close()
    return proc.exit_code


def _torchrun_world() -> int:
    """WORLD_SIZE when this process is a torchrun worker (RANK and WORLD_SIZE set), else 1."""
    if os.environ.get("RANK") is None:
        return 1
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def _torchrun_rank(args: argparse.Namespace, config: Any, endpoints: dict[str, str]) -> int:
    """A torchrun worker is one rank (no supervisor: torchrun restarts the group) on private
    endpoints, ``tcp://--dp-rank-host:*`` (loopback by default; beyond it only as CURVE servers
    with ``--dp-curve-dir`` keys, refused before anything binds); global rank 0 also runs the
    front end on the public ones (`vconsole.engine.proc.dp.torchrun`)."""
    from vconsole.engine.proc.dp.torchrun import TorchrunFrontEnd, rank_curves, rank_endpoints
    from vconsole.security.bind_policy import check_endpoints
    front_end = int(os.environ.get("RANK") or 0) == 0
    try:
        curve = server_curve(args)
        private = rank_endpoints(endpoints, getattr(args, "dp_rank_host", None))
        check_endpoints(private, False, curve=bool(getattr(args, "dp_curve_dir", None)))
        rank_curve, front_curve = rank_curves(getattr(args, "dp_curve_dir", None),
                                              front_end=front_end)
    except (ValueError, CurveKeyError) as e:    # RemoteBindRefused is a ValueError
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    try:
        front = (TorchrunFrontEnd(args, config, endpoints, curve=curve, rank_curve=front_curve)
                 if front_end else None)
    except (RemoteBindRefused, OSError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    args.metrics_port = None        # the front end's: /metrics and the key are the group's
    args.control_key_file = None
    args.allow_remote = False       # --allow-remote-telemetry is for the public endpoint
    return _serve(args, config, private, ready_file=False, curve=rank_curve, front=front)


def _launch_ranks(args: argparse.Namespace, config: Any, endpoints: dict[str, str]) -> int:
    """N ranks behind one front end on this host: `vconsole.engine.proc.dp.launcher`."""
    try:
        curve = server_curve(args)
    except (ValueError, CurveKeyError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    from vconsole.engine.proc.dp.launcher import DPLauncher
    try:
        return DPLauncher(args, config, endpoints, curve=curve).run()
    except (RemoteBindRefused, OSError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START


def _metrics_endpoint(args: argparse.Namespace) -> tuple[str, int] | None:
    """``(host, port)`` for the Prometheus server, None without ``--metrics-port``. Under the
    supervisor this port is the supervisor's relay and each child serves a private loopback
    port (`vconsole.engine.proc.metrics_relay`); ``--no-supervisor`` serves it itself."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    return getattr(args, "metrics_host", None) or "127.0.0.1", port


def _supervise(args: argparse.Namespace, config: Any, endpoints: dict[str, str]) -> int:
    """Run this very command line as a supervised child; see `EngineSupervisor`."""
    metrics = _metrics_endpoint(args)
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                               backoff_s=args.restart_backoff)
        curve = server_curve(args)
        if metrics is not None:
            check_metrics_host(metrics[0], bool(getattr(args, "allow_remote_metrics", False)))
    except (ValueError, CurveKeyError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    argv = getattr(args, "argv", None) or sys.argv[1:]
    supervisor = EngineSupervisor(
        [sys.executable, "-m", "vconsole", *argv], endpoints, engine_id=config.engine_id,
        rank=config.dp_rank, policy=policy, ready_file=getattr(args, "ready_file", None),
        heartbeat_interval_s=config.heartbeat_interval_s, sndhwm=config.zmq_sndhwm, curve=curve,
        hang_timeout_s=args.hang_timeout, metrics=metrics)
    try:
        code = supervisor.run()
    except OSError as e:    # the metrics port is taken
        print(f"vconsole engine: cannot serve metrics on {metrics}: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    if supervisor.failure:
        print(f"vconsole engine: {supervisor.failure}", file=sys.stderr)
    return code
