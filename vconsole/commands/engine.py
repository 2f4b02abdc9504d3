"""`vconsole engine`: run EngineCoreProc in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
from typing import Any

from vconsole.engine.config import ConfigError, config_from_args
from vconsole.engine.proc.bind_policy import RemoteBindRefused
from vconsole.engine.proc.core_proc import RELOAD, SHUTDOWN, EngineCoreProc
from vconsole.telemetry.endpoints import DEFAULTS


def _install_signal_handlers(q: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """SIGINT/SIGTERM: drain and exit 0 (a second one: exit now). SIGHUP: reload --config."""
    count = 0

    def on_stop(signum: int, _frame: Any) -> None:
        nonlocal count
        count += 1
        if count > 1:
            raise KeyboardInterrupt
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
    q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    _install_signal_handlers(q)
    try:
        proc = EngineCoreProc(config, endpoints, config_path=getattr(args, "config", None),
                              allow_remote=bool(getattr(args, "allow_remote", False)),
                              control_key_file=getattr(args, "control_key_file", None),
                              input_queue=q, ready_file=getattr(args, "ready_file", None))
    except (RemoteBindRefused, OSError) as e:
        print(f"vconsole engine: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the model or the KV pool: the loader says why
        print(f"vconsole engine: cannot start: {e}", file=sys.stderr)
        return 1
    proc.start()
    ep = proc.endpoints
    print(f"vconsole engine {config.engine_id} ready (pid {os.getpid()}): input={ep['input']} "
          f"output={ep['output']} telemetry={ep['telemetry']} control={ep['control']}",
          flush=True)
    proc.run_busy_loop()
    return 0
