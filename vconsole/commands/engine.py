"""`vconsole engine`: run EngineCoreProc until SIGINT/SIGTERM, under a supervisor by default.

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
from typing import Any

from vconsole.commands.curve_args import server_curve
from vconsole.engine.config import ConfigError, config_from_args
from vconsole.engine.proc import exit_codes
from vconsole.engine.proc.bind_policy import RemoteBindRefused
from vconsole.engine.proc.core_proc import RELOAD, SHUTDOWN, EngineCoreProc
from vconsole.engine.proc.supervisor import EngineSupervisor, RestartPolicy
from vconsole.telemetry.curve import CurveKeyError
from vconsole.telemetry.endpoints import DEFAULTS


def _install_signal_handlers(q: queue.SimpleQueue[tuple[Any, ...]], *,
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
        q.put((SHUTDOWN, signal.Signals(signum).name))

    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGTERM, on_stop)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: q.put((RELOAD, "SIGHUP")))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"vconsole engine: invalid config: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # an unreadable --config file
        print(f"vconsole engine: {e}", file=sys.stderr)
        return 2
    endpoints = {name: getattr(args, name, None) or default for name, default in DEFAULTS.items()}
    supervised_child = bool(getattr(args, "supervised_child", False))
    if not supervised_child and not getattr(args, "no_supervisor", False):
        return _supervise(args, config, endpoints)
    q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    _install_signal_handlers(q, escalate=not supervised_child)
    try:
        proc = EngineCoreProc(config, endpoints, config_path=getattr(args, "config", None),
                              allow_remote=bool(getattr(args, "allow_remote", False)),
                              control_key_file=getattr(args, "control_key_file", None),
                              input_queue=q, ready_file=getattr(args, "ready_file", None),
                              curve=server_curve(args),
                              restart_count=getattr(args, "restart_count", 0) or 0,
                              restart_reason=getattr(args, "restart_reason", None),
                              metrics_endpoint=_metrics_endpoint(args),
                              allow_remote_metrics=bool(getattr(args, "allow_remote_metrics",
                                                                False)))
    except (RemoteBindRefused, CurveKeyError, OSError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the model or the KV pool: the loader says why
        print(f"vconsole engine: cannot start: {e}", file=sys.stderr)
        return 1
    proc.start()
    ep = proc.endpoints
    print(f"vconsole engine {config.engine_id} ready (pid {os.getpid()}): input={ep['input']} "
          f"output={ep['output']} telemetry={ep['telemetry']} control={ep['control']}"
          + (f" metrics={proc.metrics.url}" if proc.metrics is not None else ""), flush=True)
    proc.run_busy_loop()
    return proc.exit_code


def _metrics_endpoint(args: argparse.Namespace) -> tuple[str, int] | None:
    """``(host, port)`` for the Prometheus server, None without ``--metrics-port``. Only the
    process that runs the engine serves it (a supervised child, or ``--no-supervisor``); the
    supervisor passes a port 0 resolved by the first child to every later one."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    return getattr(args, "metrics_host", None) or "127.0.0.1", port


def _supervise(args: argparse.Namespace, config: Any, endpoints: dict[str, str]) -> int:
    """Run this very command line as a supervised child; see `EngineSupervisor`."""
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                               backoff_s=args.restart_backoff)
        curve = server_curve(args)
    except (ValueError, CurveKeyError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return exit_codes.CANNOT_START
    argv = getattr(args, "argv", None) or sys.argv[1:]
    supervisor = EngineSupervisor(
        [sys.executable, "-m", "vconsole", *argv], endpoints, engine_id=config.engine_id,
        rank=config.dp_rank, policy=policy, ready_file=getattr(args, "ready_file", None),
        heartbeat_interval_s=config.heartbeat_interval_s, sndhwm=config.zmq_sndhwm, curve=curve)
    code = supervisor.run()
    if supervisor.failure:
        print(f"vconsole engine: {supervisor.failure}", file=sys.stderr)
    return code
