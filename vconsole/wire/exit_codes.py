"""The engine process's exit codes: what `vconsole engine` returns and its supervisor reads.

The supervisor (`vconsole.engine.launch.supervisor`) restarts an engine that exited with anything
but `OK` and `CANNOT_START`: the first is a stop somebody asked for, the second a start that can
never succeed (invalid config, a port it may not or cannot bind, bad flags), so restarting it
would only loop. A process killed by a signal has no exit code; the supervisor restarts it too.
"""

from __future__ import annotations

import signal

OK = 0                  # stopped on request (SIGTERM/SIGINT) after draining
FAILED = 1              # the engine could not start this time (e.g. the model failed to load)
CANNOT_START = 2        # never will start as configured: do not restart
STEP_FAILURES = 3       # model execution failed on ``max_consecutive_step_failures`` steps in a row
GAVE_UP = 4             # supervisor only: the engine kept failing (``--max-restarts``)


def describe_exit(returncode: int) -> str:
    """A child's `subprocess.Popen.returncode` as a person reads it: ``exit code 1``,
    ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == STEP_FAILURES:
        return f"exit code {returncode} (model execution kept failing)"
    return f"exit code {returncode}"
